"""The audit's per-package summary (FlashInfer's AOT modules beside vLLM's in one image),
`--source` refused before any work, and the source-backed verdict of each decide outcome."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest

from devkit.helpers import ROOT, cli, compile_cached, gencode, one_line_error
from sm121_build.audit.judge import judged, package_name
from sm121_build.audit.report import package_of, packages
from sm121_build.cuda.binary import host_only_report
from sm121_build.cuda.compat import DEFAULT_TARGET
from sm121_build.rebuild.decide import ExtensionVerdict

SCHEMA = json.loads((ROOT / "sm121_build/data/schemas/audit.schema.json").read_text())
SITE = "usr/local/lib/python3.12/dist-packages"


@pytest.mark.parametrize(("name", "package"), [
    (f"{SITE}/vllm/_C.abi3.so", "vllm"),
    (f"{SITE}/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm"),
    (f"{SITE}/flashinfer_cubin/cubins/a/b.cubin", "flashinfer_cubin"),
    ("opt/venv/lib/python3.12/site-packages/flashinfer_jit_cache/jit/x.so",
     "flashinfer_jit_cache"),
    (f"{SITE}/stray.so", "dist-packages"),  # a module at the top of site-packages
    ("vllm/_C.abi3.so", "vllm"),  # a wheel's or a folder's top folder
    ("_C.abi3.so", "."),
])
def test_package_of(name: str, package: str) -> None:
    assert package_of(name) == package


@pytest.mark.parametrize(("name", "in_vllm"), [
    (f"{SITE}/vllm/_C.abi3.so", "_C.abi3.so"),
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm_flash_attn/_vllm_fa2_C.abi3.so"),
    ("a/vllm/b/vllm/_C.abi3.so", "_C.abi3.so"),  # the innermost vllm folder
    (f"{SITE}/flashinfer/x.so", None),
    ("vllm", None),
])
def test_package_name_relative_to_vllm(name: str, in_vllm: str | None) -> None:
    assert package_name(name) == in_vllm


@pytest.fixture(scope="module")
def two_packages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder laid out like an image's site-packages: vLLM with a native and a JIT-only
    extension, FlashInfer with an sm_100f-only module and a host-only one (real nvcc)."""
    root = tmp_path_factory.mktemp("site")
    native = compile_cached("pkg-native", ROOT / "tests/data/kernels.cu",
                            gencode("compute_120:sm_120"))
    jit = compile_cached("pkg-jit", ROOT / "tests/data/kernels.cu",
                         gencode("compute_80:compute_80"))
    foreign = compile_cached("pkg-100f", ROOT / "tests/data/kernels.cu",
                             gencode("compute_100f:sm_100f"))
    for rel, source in ((f"{SITE}/vllm/_C.abi3.so", native),
                        (f"{SITE}/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", jit),
                        (f"{SITE}/flashinfer_jit_cache/jit/fmha.so", foreign)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, root / rel)
    return root


def test_each_package_says_how_much_of_it_loads(two_packages: Path) -> None:
    done = cli("audit", str(two_packages))
    assert done.returncode == 0, done.stderr
    summary = done.stdout.split("per package, on sm_121:\n", 1)[1].splitlines()
    assert summary[0] == (
        "  flashinfer_jit_cache: 0 of 1 file(s) native (1 none); kernels 0 of 4 native, 0 JIT "
        "only, 4 with no loadable code; 1 file(s) only a build for the GPU makes native")
    assert re.fullmatch(
        r"  vllm: 1 of 2 file\(s\) native \(1 jit, 1 native\); kernels 4 of 8 native, 4 JIT "
        r"only, 0 with no loadable code; aot: 1 file\(s\), about \d+ CPU-s of ptxas",
        summary[1]), summary[1]
    data = json.loads(cli("audit", "--json", str(two_packages)).stdout)
    jsonschema.validate(data, SCHEMA)
    by_name = {p["name"]: p for p in data["packages"]}
    assert by_name["vllm"]["files"] == {"native": 1, "jit": 1, "partial": 0, "none": 0}
    assert by_name["flashinfer_jit_cache"]["files"]["none"] == 1
    assert by_name["flashinfer_jit_cache"]["beyond_aot"] == 1
    assert by_name["vllm"]["aot"]["files"] == 1 and by_name["vllm"]["beyond_aot"] == 0
    vllm = by_name["vllm"]["kernels"]
    assert vllm["native"] > 0 and vllm["jit"] > 0 and vllm["none"] == 0
    # without kernel names the files still count, the kernels do not
    headers = json.loads(cli("audit", "--json", "--no-kernels", str(two_packages)).stdout)
    assert all(p["kernels"] is None for p in headers["packages"])
    fmha = next(b for b in data["binaries"] if b["name"].endswith("fmha.so"))
    assert fmha["rebuild"]["reason"].endswith("the binary cannot tell")  # not vLLM's source


def test_one_file_has_no_package_summary(two_packages: Path) -> None:
    done = cli("audit", str(two_packages / SITE / "vllm/_C.abi3.so"))
    assert done.returncode == 0 and "per package" not in done.stdout


@pytest.mark.parametrize("layout", ["folder", "image tarball"])
def test_a_file_two_records_claim_is_said_with_both_distributions(
        two_packages: Path, tmp_path: Path, layout: str) -> None:
    """Two `.dist-info` RECORDs that list one file (two wheels installed onto one path): a
    warning names the file and both distributions, the JSON lists both, and the file is
    counted under one of them whichever RECORD was read first (auditwheel-like: said, not
    refused)."""
    site = tmp_path / "site-packages"
    lib = "nvidia/cu13/lib"
    shutil.copytree(two_packages / SITE / "vllm", site / lib)
    for dist, rows in (("nvidia_nccl_cu13-2.28.9", [f"{lib}/_C.abi3.so"]),
                       ("nvidia_cublas-13.1.0.3", [f"{lib}/_C.abi3.so",
                                                    f"{lib}/vllm_flash_attn/_vllm_fa2_C.abi3.so"])):
        (site / f"{dist}.dist-info").mkdir()
        (site / f"{dist}.dist-info/RECORD").write_text("".join(f"{r},sha256=x,1\n" for r in rows))
    target, prefix = site, ""
    if layout == "image tarball":
        from devkit.imagetar import docker_save

        prefix = "/usr/lib/python3/site-packages/"
        target = docker_save(tmp_path / "image.tar", [{
            f"usr/lib/python3/site-packages/{p.relative_to(site).as_posix()}": p.read_bytes()
            for p in sorted(site.rglob("*")) if p.is_file()}])
    done = cli("audit", "--json", str(target), "--target", "sm_121", "--driver", "13.0")
    assert done.returncode == 0, done.stderr
    jsonschema.validate(data := json.loads(done.stdout), SCHEMA)
    assert f"warning: {prefix}{lib}/_C.abi3.so is listed by the RECORDs of 2 distributions " \
        "(nvidia-cublas, nvidia-nccl-cu13): counted under nvidia-cublas" in \
        done.stderr.splitlines(), done.stderr
    assert done.stderr.count("warning:") == 1, done.stderr
    by_name = {b["name"]: b for b in data["binaries"]}
    shared = by_name[f"{prefix}{lib}/_C.abi3.so"]
    assert (shared["package"], shared["claimed_by"]) == (
        "nvidia-cublas", ["nvidia-cublas", "nvidia-nccl-cu13"])
    alone = by_name[f"{prefix}{lib}/vllm_flash_attn/_vllm_fa2_C.abi3.so"]
    assert (alone["package"], alone["claimed_by"]) == ("nvidia-cublas", ["nvidia-cublas"])


def test_files_without_device_code_are_no_package() -> None:
    assert packages([host_only_report("vllm/cumem_allocator.abi3.so", 1, True)]) == []


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p / "missing", r"--source .*/missing: not a vLLM source tree \(no "
                              r"CMakeLists.txt\)$"),
    (lambda p: p, r"--source .*: not a vLLM source tree \(no CMakeLists.txt\)$"),
    (lambda p: (p / "CMakeLists.txt").write_text("project(x)\n") and p,
     r"--source .*: no vLLM version found \(vllm/_version.py or PKG-INFO\)$"),
])
def test_a_bad_source_is_refused_before_any_work(tmp_path: Path, make: object,
                                                 message: str) -> None:
    source = make(tmp_path)  # type: ignore[operator]
    # the target does not exist: the source is refused first, before the audit starts
    line = one_line_error(cli("audit", str(tmp_path / "absent.whl"), "--source",
                              str(source)), alone=True)
    assert re.search(message, line), line


def test_a_bad_cuda_version_is_refused(tmp_path: Path) -> None:
    line = one_line_error(cli("audit", str(tmp_path), "--cuda", "thirteen"))
    assert "thirteen" in line


def _plan(outcome: str, before: dict[str, int], foreign: tuple[str, ...] = (),
          remains: tuple[str, ...] = ()) -> ExtensionVerdict:
    return ExtensionVerdict("_x_C.abi3.so", "_x_C", before, before, outcome == "build",
                         f"reason of {outcome}", remains, outcome,  # type: ignore[arg-type]
                         foreign)


@pytest.mark.parametrize(("outcome", "foreign", "verdict", "reason"), [
    ("build", (), "fixable", "reason of build; stays (sm121-build --base IMAGE builds it)"),
    ("native", (), "native", "reason of native"),
    ("below share", (), "optional", "reason of below share; stays"),
    ("unbuildable", ("sm_90a",), "no rule", "reason of unbuildable; stays"),
    ("no gain", (), "no rule", "reason of no gain; stays"),
    ("no gain", ("sm_90a", "sm_100f"), "no sm_12x implementation",
     "no guard of the source gives _x_C code sm_121 loads; its 3 kernel(s) that load nothing "
     "are only for sm_90a, sm_100f (arch/family-specific instructions of other GPUs); 2 "
     "kernel(s) stay JIT-only"),
])
def test_each_decide_outcome_has_its_verdict(outcome: str, foreign: tuple[str, ...],
                                             verdict: str, reason: str) -> None:
    found = judged(_plan(outcome, {"native": 1, "jit": 2, "none": 3}, foreign,
                         remains=("stays",)), DEFAULT_TARGET)
    assert (found.verdict, found.reason) == (verdict, reason)
