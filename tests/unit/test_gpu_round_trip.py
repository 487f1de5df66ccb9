"""`--gpu` is one value carried end to end (issue #47): every GPU the command line accepts
round-trips through what the tool writes for it (the result's tag suffix, the kernels
image's pinned tag and reuse key, the manifest, the labels) and is read back as the same
GPU; files made for one GPU are refused by a run for another, both ways; the Spark's
default run writes what it wrote before (its reuse key and manifest unchanged)."""

from __future__ import annotations

import click
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sm121_build.cli.params import arch_for_gpu, gpu_value
from sm121_build.core.labels import FIELD_LABELS
from sm121_build.cuda.binary import DEFAULT_POLICY, Policy, gpu_of_arch_list
from sm121_build.cuda.compat import ArchList, parse_target
from sm121_build.image.refs import default_tag
from sm121_build.jobs.formats import artifacts
from sm121_build.jobs.formats.render import gpu_label
from sm121_build.jobs.kernel_images.kernels_image import gpu_refusal, pinned_tag, reuse_key

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

# compute capabilities of real GPUs (CUDA 12.8-13.x), spelt every way the option takes them
_ARCHS = (75, 80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)
_SPELLINGS = st.sampled_from(_ARCHS).flatmap(lambda arch: st.sampled_from([
    f"sm_{arch}", str(arch), f"{arch // 10}.{arch % 10}", f"compute_{arch}"]))


def _manifest(gpu: Policy | None, arch_list: str) -> artifacts.Manifest:
    provenance = artifacts.Provenance(
        base="vllm/vllm-openai:v0.33.0", base_digest="", vllm_version="0.33.0",
        vllm_commit="c" * 40, arch_list=arch_list, patches="aot-ptxas-13.0.88",
        package_dir="/usr/local/lib/python3.12/dist-packages/vllm", tool_version="0.1.0",
        vllm_commit_id="c" * 40, torch_version="2.11.0+cu130", platform="linux/arm64",
        gpu=str(gpu) if gpu is not None else None)
    return artifacts.Manifest(provenance, {"_C.abi3.so": artifacts.FileRecord(
        "0" * 64, "755", {"sm_121": 1}, 1)})


@settings(max_examples=200, deadline=None)
@given(_SPELLINGS)
def test_a_gpu_is_read_back_the_same_from_everything_written_for_it(written: str) -> None:
    gpu = gpu_value(None, None, written)
    assert gpu == Policy(parse_target(written), (13, 0))
    arch = arch_for_gpu(None, gpu)  # what the run records for it
    # the result's tag
    suffix = default_tag("vllm/vllm-openai:nightly", gpu.suffix).rsplit("-", 1)[1]
    assert gpu_value(None, None, suffix.removeprefix("sm")) == gpu
    # the kernels image's pinned tag names its arch list, which names the GPU alone
    pinned = pinned_tag("0.33.0", "c" * 40, arch, "2.11.0+cu130")
    assert pinned.endswith(f"-{gpu.suffix}")
    assert gpu_of_arch_list(arch) == gpu
    # the manifest, through its JSON, and the label
    manifest = artifacts.Manifest.from_json(_manifest(gpu, str(arch)).as_json())
    assert manifest.provenance.served == str(gpu)
    assert gpu_value(None, None, gpu_label(str(gpu))[FIELD_LABELS["gpu"]]) == gpu
    # the reuse key: one per GPU
    keys = {reuse_key(_manifest(other, str(other.arch_list)))
            for other in (gpu, DEFAULT_POLICY, Policy(parse_target("sm_120"), (13, 0)))}
    assert len(keys) == len({gpu, DEFAULT_POLICY, Policy(parse_target("sm_120"), (13, 0))})


@pytest.mark.parametrize(("made", "run"), [("sm_120", "sm_121"), ("sm_121", "sm_120"),
                                           ("sm_90", "sm_121"), ("sm_121", "sm_110")])
def test_files_made_for_one_gpu_are_refused_by_a_run_for_another(made: str, run: str) -> None:
    made_for = gpu_value(None, None, made)
    built = _manifest(made_for, str(made_for.arch_list)).provenance
    why = gpu_refusal(built, gpu_value(None, None, run))
    assert why is not None
    assert why.what == f"were made for {made}; this run serves {run}"
    assert f"--gpu {made} uses them" in why.hint
    assert gpu_refusal(built, made_for) is None


def test_a_manifest_from_before_gpu_serves_what_its_arch_list_names() -> None:
    assert _manifest(None, "12.1").provenance.served == "sm_121"
    assert _manifest(None, "12.1a").provenance.served == "sm_121"
    assert _manifest(None, "12.0f").provenance.served == "sm_120"
    assert _manifest(None, "9.0;12.1").provenance.served == "sm_121"  # a source build's
    assert "gpu" not in _manifest(None, "12.1").as_json()  # nothing new is written for it


def test_the_sparks_reuse_key_is_what_it_was_before_gpu() -> None:
    """The key a published Spark kernels image carries (the digest of its parts, as before
    `--gpu`): an existing image is still found by a run of this version."""
    import hashlib

    manifest = _manifest(DEFAULT_POLICY, "12.1")
    built = manifest.provenance
    before = hashlib.sha256("\0".join([
        built.vllm_commit_id or "", built.torch_version or "", built.arch_list, built.patches,
        "_C.abi3.so", built.platform or ""]).encode()).hexdigest()[:24]
    assert reuse_key(manifest) == before
    assert reuse_key(_manifest(None, "12.1")) == before


def test_a_source_builds_arch_list_is_refused_for_another_gpu() -> None:
    sm120 = gpu_value(None, None, "sm_120")
    assert arch_for_gpu(None, sm120) == ArchList.parse("12.0")
    with pytest.raises(click.BadParameter, match="a source build is for sm_121 only"):
        arch_for_gpu(ARCHS_121, sm120)
    assert arch_for_gpu(ArchList.parse("12.1a"), DEFAULT_POLICY) == ArchList.parse("12.1a")
    assert arch_for_gpu(None, DEFAULT_POLICY) == ARCHS_121


def test_an_unknown_gpu_is_one_error() -> None:
    with pytest.raises(click.BadParameter):
        gpu_value(None, None, "rtx5090")


def test_the_main_job_takes_gpu_and_driver_before_any_work() -> None:
    from devkit.helpers import cli, one_line_error

    env = {"DOCKER_HOST": "unix:///nonexistent.sock"}
    bad = cli("--base", "vllm/vllm-openai:nightly", "--gpu", "rtx5090", env=env)
    assert bad.returncode == 2 and "--gpu" in bad.stderr
    driver = cli("--base", "vllm/vllm-openai:nightly", "--driver", "thirteen", env=env)
    assert "unknown CUDA driver version 'thirteen'" in one_line_error(driver)
    source = cli("--base", "vllm/vllm-openai:nightly", "--gpu", "sm_120", "--from-source",
                 env=env)
    assert "a source build (--source, --from-source, --force, --no-patch) is for sm_121 " \
        "only" in one_line_error(source)
    arch = cli("--base", "vllm/vllm-openai:nightly", "--gpu", "sm_120", "--arch", "12.1",
               env=env)
    assert arch.returncode == 2 and "a source build is for sm_121 only" in arch.stderr
