"""Each verification check on crafted inputs: real ELF files (g++/nvcc), made-up layer lists."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from devkit.dirfiles import DirectoryFiles
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.binary import DEFAULT_POLICY, BinaryReport, audit_binary
from sm121_build.cuda.dynsym import dynamic_symbols
from sm121_build.image.api import HistoryStep, ImageInfo
from sm121_build.image.engine import failure_cause
from sm121_build.image.facts import VllmInstall
from sm121_build.jobs.formats import artifacts
from sm121_build.verify.checks import (
    KernelComparison,
    check_abi,
    check_cubins,
    check_drift,
    check_version,
    compare_kernels,
    copy_destination,
    cubins_of,
    image_torch_exports,
    kernel_key,
    newest_of,
    torch_exports,
)

PKG = "usr/lib/python3/dist-packages/vllm"


def _info(layers: tuple[str, ...], env: tuple[str, ...] = ("PATH=/bin",)) -> ImageInfo:
    return ImageInfo(ref="x", id="sha256:" + "0" * 64, repo_digests=(), os="linux",
                     architecture="arm64", variant="", labels={}, layers=layers, env=env,
                     runtime=('["python3"]',))


STOCK = _info(("sha256:a", "sha256:b"))


SIZES = {f"{PKG}/_C.abi3.so": 1000, f"{PKG}/_moe_C.abi3.so": 500}
# Newest first, as `docker history` lists them (BuildKit's and the legacy builder's words).
ADDED = [HistoryStep('LABEL "io.github.sm121-build.tool"="x"', 0),
         HistoryStep(f"COPY /sm121/out/_moe_C.abi3.so /{PKG}/_moe_C.abi3.so # buildkit", 500),
         HistoryStep(f"/bin/sh -c #(nop) COPY file:0a1b in /{PKG}/_C.abi3.so ", 1000)]


def test_copy_destination_for_both_builders() -> None:
    assert copy_destination(ADDED[1].created_by) == f"/{PKG}/_moe_C.abi3.so"
    assert copy_destination(ADDED[2].created_by) == f"/{PKG}/_C.abi3.so"
    assert copy_destination("/bin/sh -c #(nop)  LABEL a=b") is None
    assert copy_destination("RUN /bin/sh -c cp x /y # buildkit") is None


def test_drift_passes_when_only_the_injected_files_are_added() -> None:
    built = _info(("sha256:a", "sha256:b", "sha256:c", "sha256:d"))
    assert check_drift(STOCK, built, ADDED, SIZES) == []


def test_drift_reports_every_other_change() -> None:
    built = _info(("sha256:a", "sha256:b", "sha256:c", "sha256:d", "sha256:e", "sha256:f"))
    added = [HistoryStep("RUN /bin/sh -c rm /etc/passwd # buildkit", 0),
             HistoryStep(f"COPY config.py /{PKG}/config.py # buildkit", 10),
             HistoryStep(f"COPY /sm121/out/_moe_C.abi3.so /{PKG}/_moe_C.abi3.so # buildkit",
                         501),
             *ADDED[2:]]
    problems = check_drift(STOCK, built, added, SIZES)
    assert problems == [
        f"drift: added step 'COPY /sm121/out/_moe_C.abi3.so /{PKG}/_moe_C.abi3.so # buildkit' "
        "(501 bytes) is not a copy of one injected file",
        f"drift: added step 'COPY config.py /{PKG}/config.py # buildkit' (10 bytes) is not a "
        "copy of one injected file",
        "drift: added step 'RUN /bin/sh -c rm /etc/passwd # buildkit' (0 bytes) is not a copy "
        "of one injected file",
        f"drift: no added layer holds /{PKG}/_moe_C.abi3.so as built",
        "drift: 4 layer(s) added on top of the stock image, 1 accounted for by copies of the "
        "injected files"]


METADATA = ("LABEL", "ENV", "CMD", "ENTRYPOINT", "WORKDIR", "USER", "EXPOSE", "STOPSIGNAL",
            "HEALTHCHECK", "SHELL", "VOLUME", "ARG", "ONBUILD", "MAINTAINER")


@pytest.mark.parametrize("word", METADATA)
def test_metadata_only_steps_are_no_drift_in_both_builders_words(word: str) -> None:
    built = _info(("sha256:a", "sha256:b", "sha256:c", "sha256:d"))
    for created_by in (f"{word} x=1", f"/bin/sh -c #(nop)  {word} x=1"):
        added = [HistoryStep(created_by, 0), *ADDED[1:]]
        assert check_drift(STOCK, built, added, SIZES) == [], created_by
        grew = [HistoryStep(created_by, 7), *ADDED[1:]]  # a "metadata" step that adds bytes
        assert check_drift(STOCK, built, grew, SIZES)[0].startswith(
            f"drift: added step {created_by!r} (7 bytes)"), created_by


@pytest.mark.parametrize("created_by", ["RUN true", "/bin/sh -c #(nop)  COPYX a /b", "", "#(nop)",
                                        "label x=1"])
def test_other_empty_steps_are_drift(created_by: str) -> None:
    built = _info(("sha256:a", "sha256:b", "sha256:c", "sha256:d"))
    added = [HistoryStep(created_by, 0), *ADDED[1:]]
    assert check_drift(STOCK, built, added, SIZES) == [
        f"drift: added step {created_by.strip()!r} (0 bytes) is not a copy of one injected file"]


def test_drift_counts_layers_the_history_does_not_explain() -> None:
    built = _info(("sha256:a", "sha256:b", "sha256:c", "sha256:d", "sha256:e"))
    assert check_drift(STOCK, built, ADDED, SIZES) == [
        "drift: 3 layer(s) added on top of the stock image, 2 accounted for by copies of the "
        "injected files"]


def test_drift_reports_replaced_base_layers_and_config() -> None:
    squashed = _info(("sha256:a", "sha256:z", "sha256:c"), env=("PATH=/other",))
    problems = check_drift(STOCK, squashed, [], {})
    assert problems[0] == ("the built image does not keep the stock image's 2 layers "
                           "(first difference at layer 1)")
    assert problems[1] == "drift: env differs from the stock image (+PATH=/other, -PATH=/bin)"
    shorter = _info(("sha256:a",))  # fewer layers than the stock image: no pair differs
    assert check_drift(STOCK, shorter, [], {})[0] == (
        "the built image does not keep the stock image's 2 layers (first difference at layer "
        "1)")


def test_a_long_unexplained_step_is_quoted_to_120_characters() -> None:
    long = "RUN " + "x" * 200
    built = _info(("sha256:a", "sha256:b", "sha256:c", "sha256:d"))
    problems = check_drift(STOCK, built, [HistoryStep(long, 7), *ADDED[1:]], SIZES)
    assert problems[0] == f"drift: added step {long[:120]!r} (7 bytes) is not a copy of one " \
                          "injected file"


def test_legacy_add_steps_and_kernel_keys() -> None:
    assert copy_destination(f"/bin/sh -c #(nop) ADD file:0a1b in /{PKG}/x.so ") == f"/{PKG}/x.so"
    assert copy_destination("COPY a b") == "b" and copy_destination("ADD a") is None
    assert kernel_key("_ZN12_GLOBAL__N_1_INTERNAL_1a2b3c4d_5_x_cu_f00d5kernelEv") == \
        "_ZN12_GLOBAL__N_1_INTERNAL_00000000_5_x_cu_f00d5kernelEv"
    assert kernel_key("_Z7add_onePfi") == "_Z7add_onePfi"


def test_kernel_keys_of_a_real_rebuild_match_the_stock_names() -> None:
    """Names from PyPI's vLLM 0.33.0 `_C_stable_libtorch` and the same source rebuilt for 12.1
    with nvcc 13.0 (docs/real-build.md): the anonymous-namespace hash and CUB's arch list
    differ, the kernels are the same."""
    stock = ("_ZN4vllm66_GLOBAL__N__49227196_33_fused_qknorm_rope_cache_kernel_cu_1f3c75c524"
             "qknorm_rope_cache_kernelIN3c104HalfES3_Li128EEEvPKv")
    built = ("_ZN4vllm66_GLOBAL__N__5d199633_33_fused_qknorm_rope_cache_kernel_cu_1f3c75c524"
             "qknorm_rope_cache_kernelIN3c104HalfES3_Li128EEEvPKv")
    assert kernel_key(stock) == kernel_key(built) != stock
    assert kernel_key(stock) == ("_ZN4vllm45_GLOBAL__N__fused_qknorm_rope_cache_kernel_cu24"
                                 "qknorm_rope_cache_kernelIN3c104HalfES3_Li128EEEvPKv")
    other_file = built.replace("33_fused_qknorm", "33_fused_qknorX")  # another file
    assert kernel_key(other_file) != kernel_key(stock)
    # the source's path hash and a counter vary too (vLLM's dcp_direct_* files)
    dcp_stock = ("_ZN60_GLOBAL__N__4bca23eb_22_dcp_direct_q_gather_cu_d1c01ebb_662135direct_"
                 "dcp_q_gather_multimem_kernelEPK5uint4")
    dcp_built = ("_ZN60_GLOBAL__N__5ecf7915_22_dcp_direct_q_gather_cu_93f2c534_150135direct_"
                 "dcp_q_gather_multimem_kernelEPK5uint4")
    assert kernel_key(dcp_stock) == kernel_key(dcp_built) == (
        "_ZN34_GLOBAL__N__dcp_direct_q_gather_cu35direct_dcp_q_gather_multimem_kernelEPK5uint4")
    cub_stock = "_ZN3cub44CUB_300001_SM_800_870_890_900_1000_1100_12006detail11EmptyKernelIvEEvv"
    cub_built = "_ZN3cub18CUB_300001_SM_12006detail11EmptyKernelIvEEvv"
    assert kernel_key(cub_stock) == kernel_key(cub_built) == \
        "_ZN3cub6CUB_SM6detail11EmptyKernelIvEEvv"
    assert kernel_key("_ZN12_GLOBAL__N__1_abc") == "_ZN12_GLOBAL__N__1_abc"  # not nvcc's
    assert kernel_key("_ZN3cub18CUB_300001_SM_12006detail11OtherKernelIvEEvv") != \
        kernel_key(cub_built)
    wrong_length = "_ZN3cub30CUB_300001_SM_12006detail"  # no namespace of that length: kept
    assert kernel_key(wrong_length) == wrong_length


def test_compare_kernels_and_check_cubins_on_real_files(matrix: dict[str, Path]) -> None:
    built = audit_binary(matrix["sm121"], "_C.abi3.so", DEFAULT_POLICY, with_kernels=True)
    found = compare_kernels("_C.abi3.so", matrix["sm90"], built)
    assert (found.name, found.stock_arch) == ("_C.abi3.so", "sm_90")
    assert found.stock_kernels == found.built_native and len(found.stock_kernels) == 4
    assert compare_kernels("_C.abi3.so", None, built) == KernelComparison(
        "_C.abi3.so", None, frozenset(), found.built_native)
    assert check_cubins(built) == []
    old = audit_binary(matrix["sm90"], "_C.abi3.so", DEFAULT_POLICY, with_kernels=True)
    assert check_cubins(old) == [
        "_C.abi3.so carries no sm_121-loadable cubin (cubins: {'sm_90': 2})"]
    ptx = audit_binary(matrix["ptx_only"], "p.so", DEFAULT_POLICY, with_kernels=True)
    assert check_cubins(ptx) == ["p.so carries no sm_121-loadable cubin (cubins: none)"]


def test_for_another_gpu_every_kernel_it_loaded_must_be_native(matrix: dict[str, Path]) -> None:
    """aot for sm_90 (`--gpu`): the reference is what the stock file gave sm_90 at all,
    natively or through the JIT (not the stock file's newest arch, the Spark's rule): a
    file whose kernels are native there passes; one that still only JITs them does not."""
    from sm121_build.cuda.binary import gpu_policy

    sm90 = gpu_policy("sm_90")
    stock = audit_binary(matrix["ptx_only"], "p.so", sm90, with_kernels=True)
    assert stock.kernels and set(stock.kernels.values()) == {"jit"}
    same = compare_kernels("p.so", matrix["ptx_only"], stock, sm90.target, stock)
    assert same.stock_arch == "loadable on sm_90" and same.stock_kernels
    assert same.problems() == [
        f"p.so: kernel {k} is loadable on sm_90 in the stock image (natively or through the "
        "JIT) but not native there in the build" for k in sorted(same.stock_kernels)]
    native = audit_binary(matrix["sm90"], "_C.abi3.so", sm90, with_kernels=True)
    found = compare_kernels("_C.abi3.so", matrix["sm90"], native, sm90.target, native)
    assert found.problems() == [] and found.target == "sm_90"


def _vllm(version: str, commit: str | None) -> VllmInstall:
    return VllmInstall(version, commit, "/usr/lib/python3/dist-packages", "3.12", (), None,
                       None, "/usr/local/cuda", False, None)


def test_version_check() -> None:
    assert check_version(_vllm("0.19.1", "abc"), _vllm("0.19.1", "abc")) == []
    assert check_version(_vllm("0.19.1", "abc"), _vllm("0.19.1", "abd")) == [
        "vLLM in the built image is 0.19.1 (abd), the stock image has 0.19.1 (abc)"]


def test_kernel_comparison_allows_fp4_exclusions_and_reports_them() -> None:
    stock = frozenset({"rms_norm", "silu", "_Z19nvfp4_quant_kernelPv", "cvt_fp4_e2m1"})
    ok = KernelComparison("_C.abi3.so", "sm_120", stock, frozenset({"rms_norm", "silu"}))
    assert ok.fp4_excluded == ("_Z19nvfp4_quant_kernelPv", "cvt_fp4_e2m1")
    assert ok.required == 2
    assert ok.problems() == []


def test_kernel_comparison_fails_when_non_fp4_kernels_are_lost() -> None:
    stock = frozenset({"rms_norm", "silu", "topk", "cvt_fp4_e2m1"})
    short = KernelComparison("_C.abi3.so", "sm_90", stock, frozenset({"rms_norm"}))
    assert short.problems() == [
        "_C.abi3.so: kernel silu has native sm_90 code in the stock image but none for sm_121 "
        "in the build",
        "_C.abi3.so: kernel topk has native sm_90 code in the stock image but none for sm_121 "
        "in the build"]


def test_kernel_comparison_compares_names_not_counts() -> None:
    swapped = KernelComparison("_C.abi3.so", "sm_120", frozenset({"a", "b"}),
                               frozenset({"a", "c"}))
    assert swapped.missing == ("b",)
    assert len(swapped.problems()) == 1
    fp4_kept = KernelComparison("_C.abi3.so", "sm_120", frozenset({"a", "cvt_fp4_e2m1"}),
                                frozenset({"a", "cvt_fp4_e2m1"}))
    assert (fp4_kept.problems(), fp4_kept.fp4_excluded) == ([], ())
    fp4_dropped = KernelComparison("_C.abi3.so", "sm_120", frozenset({"a", "cvt_fp4_e2m1"}),
                                   frozenset({"a"}))
    assert (fp4_dropped.problems(), fp4_dropped.fp4_excluded) == ([], ("cvt_fp4_e2m1",))


def test_newest_arch_kernels_reads_real_cubins(matrix: dict[str, Path]) -> None:
    arch, kernels = newest_of(cubins_of(matrix["sm90"]))
    assert arch == "sm_90"
    assert "_ZN4vllm15rms_norm_kernelEPfPKfi" in kernels
    assert newest_of(cubins_of(matrix["plain"]))[0] == "sm_121"
    assert newest_of(cubins_of(matrix["ptx_only"])) == (None, frozenset())


# The CUDAStream ABI break seen on Spark builds: c10::DeviceIndex changed from int8_t to
# int16_t, so getCurrentCUDAStream(signed char) and (short) mangle differently.
_PROVIDER = """
namespace c10 { namespace cuda {
struct CUDAStream { void* s; };
CUDAStream getCurrentCUDAStream(%s device) { return CUDAStream{nullptr}; }
} }
"""
_CONSUMER = """
namespace c10 { namespace cuda {
struct CUDAStream { void* s; };
CUDAStream getCurrentCUDAStream(signed char device);
} }
extern "C" void* launch() { return c10::cuda::getCurrentCUDAStream(0).s; }
"""


def _gxx_so(tmp_path: Path, name: str, source: str) -> Path:
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture()
def consumer(tmp_path: Path) -> Path:
    return _gxx_so(tmp_path, "_C.abi3", _CONSUMER)


def test_abi_check_passes_against_a_matching_torch(tmp_path: Path, consumer: Path) -> None:
    provider = _gxx_so(tmp_path, "libc10_cuda", _PROVIDER % "signed char")
    needed = dynamic_symbols(consumer).undefined
    assert "_ZN3c104cuda20getCurrentCUDAStreamEa" in needed
    result = check_abi({"_C.abi3.so": consumer}, torch_exports([provider]), 1)
    assert (result.checked, result.problems()) == (1, [])


def test_abi_check_catches_the_cuda_stream_mismatch(tmp_path: Path, consumer: Path) -> None:
    provider = _gxx_so(tmp_path, "libc10_cuda", _PROVIDER % "short")
    assert "_ZN3c104cuda20getCurrentCUDAStreamEs" in dynamic_symbols(provider).exported
    result = check_abi({"_C.abi3.so": consumer}, torch_exports([provider]), 1)
    assert result.missing == {"_C.abi3.so": ("_ZN3c104cuda20getCurrentCUDAStreamEa",)}
    assert result.problems() == [
        "ABI: _C.abi3.so needs 1 torch symbol(s) the image's torch does not export, e.g. "
        "c10::cuda::getCurrentCUDAStream(signed char) (_ZN3c104cuda20getCurrentCUDAStreamEa): "
        "built against another torch?"]
    versioned = check_abi({"_C.abi3.so": consumer}, torch_exports([provider]), 1, "2.11.0+cu130")
    assert versioned.problems()[0].startswith(
        "ABI: _C.abi3.so needs 1 torch symbol(s) the image's torch 2.11.0+cu130 does not export")


# A stable-ABI extension (vLLM's _C_stable_libtorch) calls only torch's C shim.
_SHIM_CONSUMER = """
extern "C" int aoti_torch_get_device_index(void* tensor, int* out);
extern "C" int torch_call_dispatcher(const char* name, const char* overload, void* stack);
extern "C" int launch(void* t) {
  int d = 0; aoti_torch_get_device_index(t, &d); return torch_call_dispatcher("a", "", t) + d;
}
"""
_SHIM_PROVIDER = """
extern "C" int aoti_torch_get_device_index(void* tensor, int* out) { *out = 0; return 0; }
%s
"""


def test_abi_check_covers_the_stable_c_shim(tmp_path: Path) -> None:
    consumer = _gxx_so(tmp_path, "_C_stable_libtorch.abi3", _SHIM_CONSUMER)
    full = _gxx_so(tmp_path, "libtorch_cpu", _SHIM_PROVIDER % (
        'extern "C" int torch_call_dispatcher(const char*, const char*, void*) { return 0; }'))
    result = check_abi({"_C_stable_libtorch.abi3.so": consumer}, torch_exports([full]), 1)
    assert (result.checked, result.problems()) == (2, [])
    (tmp_path / "old").mkdir()
    old = _gxx_so(tmp_path / "old", "libtorch_cpu", _SHIM_PROVIDER % "")  # lacks the dispatcher
    result = check_abi({"_C_stable_libtorch.abi3.so": consumer}, torch_exports([old]), 1)
    assert result.problems() == [  # a C name is shown as it is
        "ABI: _C_stable_libtorch.abi3.so needs 1 torch symbol(s) the image's torch does not "
        "export, e.g. torch_call_dispatcher: built against another torch?"]


def test_abi_check_without_torch_libraries(tmp_path: Path, consumer: Path,
                                           host_only_so: Path) -> None:
    assert check_abi({"host.so": host_only_so}, set(), 0).problems() == []  # needs no torch
    result = check_abi({"_C.abi3.so": consumer, "host.so": host_only_so}, set(), 0, "2.11.0")
    assert (result.checked, result.problems()) == (1, [  # the file needing none is not blamed
        "ABI: _C.abi3.so needs 1 torch symbol(s), but the image has no torch/lib/*.so to "
        "export them"])


def test_failure_cause_prefers_the_diagnosis_and_quotes_ptxas(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    log.write_text(
        "#9 1.0 ptxas /tmp/x.ptx, line 46; error   : Instruction 'cvt with .e2m1x2' not "
        "supported on .target 'sm_121'\n#9 1.2 ninja: build stopped: subcommand failed.\n"
        "#9 1.3 sm121-build: build failed: ptxas rejected an FP4 instruction\n"
        "ERROR: process did not complete successfully\n")
    assert failure_cause(log) == (
        "build failed: ptxas rejected an FP4 instruction; ptxas said: ptxas /tmp/x.ptx, line "
        "46; error   : Instruction 'cvt with .e2m1x2' not supported on .target 'sm_121'")
    log.write_text("step 1\nERROR: failed to solve: base image not found\nstep 3\n")
    assert failure_cause(log) == "ERROR: failed to solve: base image not found"


def _exported(tmp_path: Path, so: Path) -> Path:
    out = tmp_path / "artifacts"
    artifacts.export(out, {"_C.abi3.so": so}, artifacts.Provenance(
        base="b", base_digest="b", vllm_version="0.19.1", vllm_commit="abc", arch_list="12.1",
        patches="", package_dir="/site/vllm", tool_version="0"), {})
    return out


def test_artifacts_round_trip_and_modes(tmp_path: Path, host_only_so: Path) -> None:
    host_only_so.chmod(0o755)
    out = _exported(tmp_path, host_only_so)
    (out / "_C.abi3.so").chmod(0o600)  # as after a download that drops permission bits
    loaded = artifacts.load(out)
    assert (loaded.provenance.vllm_version, loaded.provenance.vllm_commit) == ("0.19.1", "abc")
    loaded.place(tmp_path / "ctx")
    assert (tmp_path / "ctx" / "_C.abi3.so").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    (lambda d: (d / "manifest.json").write_text("{"), "not valid JSON"),
    (lambda d: (d / "_C.abi3.so").write_bytes(b"changed"), "sha256 differs from the manifest"),
    (lambda d: (d / "_C.abi3.so").unlink(), "listed in the manifest but missing"),
    (lambda d: (d / "manifest.json").write_text(json.dumps(
        {"format": 1, "vllm_version": "1", "vllm_commit": "a", "arch_list": "12.1",
         "files": {"../evil.so": {}}})), "is not a .so file name"),
    (lambda d: (d / "manifest.json").write_text(json.dumps({"format": 1})),
     "missing vllm_version, vllm_commit, arch_list, files"),
])
def test_damaged_artifacts_are_one_line_errors(tmp_path: Path, host_only_so: Path,
                                                damage: Callable[[Path], object],
                                                message: str) -> None:
    out = _exported(tmp_path, host_only_so)
    damage(out)
    with pytest.raises(Sm121Error, match=message):
        artifacts.load(out)


def test_torch_exports_of_an_image_are_read_from_torch_lib_and_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    site = "/usr/local/lib/python3.12/dist-packages"
    libs = tmp_path / "image" / site.lstrip("/") / "torch" / "lib"
    libs.mkdir(parents=True)
    _gxx_so(libs, "libc10_cuda", _PROVIDER % "signed char")
    _gxx_so(libs, "libtorch_cpu", _SHIM_PROVIDER % "")
    (libs / "libc10_cuda.so.2").symlink_to("libc10_cuda.so")  # a link is not read twice
    _gxx_so(libs.parent, "libnot_torch", _PROVIDER % "short")  # not under torch/lib
    (libs / "README.txt").write_text("not a library")
    for stray in libs.glob("*.cpp"):
        stray.unlink()
    files = DirectoryFiles(tmp_path / "image")
    exported, libraries = image_torch_exports(files, "sha256:abc", site, tmp_path)
    assert libraries == 2
    assert exported == {"_ZN3c104cuda20getCurrentCUDAStreamEa", "aoti_torch_get_device_index"}
    assert not list(tmp_path.glob("*.so"))  # each library streamed to temp and dropped
    cached = tmp_path / "cache" / "sm121-build" / "abi" / "sha256-abc.v2.json"
    assert json.loads(cached.read_text()) == {"exported": sorted(exported), "libraries": 2}
    shutil.rmtree(libs)  # read back from the cache, per image ID
    assert image_torch_exports(files, "sha256:abc", site, tmp_path) == (exported, 2)
    assert image_torch_exports(files, "sha256:other", site, tmp_path) == (set(), 0)
    for damaged in ("{not json", '{"exported": 5, "libraries": 1}', "{}"):
        cached.write_text(damaged)  # a damaged cache entry: the image is read again
        assert image_torch_exports(files, "sha256:abc", site, tmp_path) == (set(), 0)


def test_abi_counts_every_file_and_every_provider(tmp_path: Path, consumer: Path) -> None:
    first = _gxx_so(tmp_path, "libc10_cuda", _PROVIDER % "signed char")
    second = _gxx_so(tmp_path, "libtorch_cpu", _SHIM_PROVIDER % "")
    both = torch_exports([first, second])
    assert both == {"_ZN3c104cuda20getCurrentCUDAStreamEa", "aoti_torch_get_device_index"}
    shim = _gxx_so(tmp_path, "_C_stable_libtorch.abi3", _SHIM_CONSUMER)
    result = check_abi({"_C.abi3.so": consumer, "_C_stable_libtorch.abi3.so": shim}, both, 2)
    assert result.checked == 3  # 1 + 2 needed symbols
    assert list(result.missing) == ["_C_stable_libtorch.abi3.so"]


def test_a_kernel_the_stock_could_jit_must_still_load(tmp_path: Path) -> None:
    """A 12.x-only rebuild that drops a family's PTX (0.33.0's hadacore: stock
    8.0+PTX;9.0+PTX, a real 12.1 configure gave it sm_90a only) turns JIT into nothing."""
    from devkit.helpers import DATA, compile_cached, gencode
    from sm121_build.verify.checks import check_still_loadable

    def report(name: str, *pairs: str) -> BinaryReport:
        built = compile_cached(f"loadable-{name}", DATA / "kernels.cu", gencode(*pairs))
        return audit_binary(built, "_C.abi3.so", DEFAULT_POLICY, with_kernels=True)

    ptx = report("ptx", "compute_80:sm_80", "compute_80:compute_80")
    gone = report("sm90a", "compute_90a:sm_90a")
    same_ptx = report("aot", "compute_80:sm_80", "compute_80:compute_80", "compute_80:sm_120")
    problems = check_still_loadable(ptx, gone)
    assert len(problems) == 4
    assert problems[0] == ("_C.abi3.so: kernel _Z5scaleIdEvPT_S0_i loads on sm_121 from the "
                           "stock file (jit) but not from the build")
    assert check_still_loadable(ptx, same_ptx) == []
    assert check_still_loadable(gone, ptx) == []  # nothing loaded before: nothing to keep
    assert check_still_loadable(None, gone) == []


def test_config_differences_are_named_one_by_one() -> None:
    from dataclasses import replace

    from sm121_build.verify.checks import check_config

    stock = replace(STOCK, env=("A=1", "B=2"), runtime=('["x"]', "null", '""', '""', "null"),
                    labels={"maintainer": "vllm", "io.github.sm121-build.old": "1"})
    assert check_config(stock, stock) == []
    reordered = replace(stock, env=("B=2", "A=1"))
    assert check_config(stock, reordered) == ["drift: env differs from the stock image ((order))"]
    changed = replace(stock, env=("A=1", "B=3"), runtime=('["x"]', '["y"]', '""', '"u"', "null"),
                      labels={"io.github.sm121-build.new": "2", "org.opencontainers.image."
                              "base.name": "b", "extra": "e"})
    assert check_config(stock, changed) == [
        "drift: env differs from the stock image (+B=3, -B=2)",
        'drift: cmd is ["y"] in the built image, null in the stock image',
        'drift: user is "u" in the built image, "" in the stock image',
        "drift: label extra is 'e' in the built image, None in the stock image",
        "drift: label maintainer is None in the built image, 'vllm' in the stock image"]
    shorter = replace(stock, runtime=stock.runtime[:4])
    assert check_config(stock, shorter) == [
        "drift: the runtime config has another shape than the stock image's"]


def test_the_default_path_a_builder_gives_a_base_with_no_path_is_not_drift() -> None:
    """`docker import` makes an image with no env; BuildKit writes Docker's default PATH into
    what it builds FROM it (the engine gives a container of either that PATH): not drift.
    Any other PATH, any PATH over a stock one, or anything beside it still is."""
    from dataclasses import replace

    from sm121_build.verify.checks import DEFAULT_PATH, check_config

    bare = replace(STOCK, env=())
    assert check_config(bare, replace(bare, env=(DEFAULT_PATH,))) == []
    assert check_config(bare, replace(bare, env=(DEFAULT_PATH, "X=1"))) != []
    assert check_config(bare, replace(bare, env=("PATH=/evil:/usr/bin",))) != []
    with_path = replace(STOCK, env=("PATH=/opt/bin",))
    assert check_config(with_path, replace(with_path, env=(DEFAULT_PATH,))) != []
    assert check_config(with_path, replace(with_path, env=("PATH=/opt/bin", DEFAULT_PATH))) != []


def test_canonical_tokens_at_the_edges() -> None:
    assert kernel_key("_Z99_GLOBAL__N__") == "_Z99_GLOBAL__N__"  # length past the end
    # a head whose file length runs past its token: left as it is
    assert kernel_key("_ZN20_GLOBAL__N__0123abcd_9_x_cu") == "_ZN20_GLOBAL__N__0123abcd_9_x_cu"
    two = ("_ZN30_GLOBAL__N__0123abcd_4_a_cu_1EN30_GLOBAL__N__89abcdef_4_b_cu_2E"
           "18CUB_300001_SM_9006detail")
    # each length-prefixed token (30 characters: `_GLOBAL__N__0123abcd_4_a_cu_1E`) is
    # replaced whole; CUB's 18-character namespace too
    assert kernel_key(two) == "_ZN16_GLOBAL__N__a_cuN16_GLOBAL__N__b_cu6CUB_SMdetail"


def test_stub_thresholds(tmp_path: Path) -> None:
    """At most STUB_BYTES on sm_121's cubin and at least STUB_RATIO times that elsewhere."""
    from sm121_build.verify.checks import STUB_BYTES, STUB_RATIO, Stub

    stub = Stub("sm_120", STUB_BYTES, "sm_90a", STUB_RATIO * STUB_BYTES)
    assert stub.describe() == f"{STUB_BYTES} bytes on sm_120, {STUB_RATIO * STUB_BYTES} on sm_90a"
    assert (STUB_BYTES, STUB_RATIO) == (512, 8)


@pytest.mark.parametrize("voucher", ["none", "changed"])
def test_a_planted_abi_cache_entry_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               voucher: str) -> None:
    """The cache is untrusted: an ABI entry the state folder does not vouch for (no digest
    recorded there, or one the entry no longer matches) is computed again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    site = "/usr/local/lib/python3.12/dist-packages"
    libs = tmp_path / "image" / site.lstrip("/") / "torch" / "lib"
    libs.mkdir(parents=True)
    _gxx_so(libs, "libc10_cuda", _PROVIDER % "signed char")
    files = DirectoryFiles(tmp_path / "image")
    cached = tmp_path / "cache" / "sm121-build" / "abi" / "sha256-abc.v2.json"
    if voucher == "changed":  # written by this tool, then changed in the cache
        real = image_torch_exports(files, "sha256:abc", site, tmp_path)
        assert real[1] == 1 and cached.is_file()
    else:
        cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({"exported": ["_ZN3c1011rt3_missingEv"], "libraries": 7}))
    exported, libraries = image_torch_exports(files, "sha256:abc", site, tmp_path)
    assert libraries == 1 and "_ZN3c1011rt3_missingEv" not in exported
    assert "_ZN3c104cuda20getCurrentCUDAStreamEa" in exported


def test_a_failed_builds_log_is_read_a_line_at_a_time_never_whole(tmp_path: Path) -> None:
    """Red team 12's lead: `failure_cause` read the whole log into memory (a log is as long
    as the build made it: one line of 48 MiB was 48 MiB held, and more as text).  It reads
    through the files-in door, a line of at most LINE_WIDTH bytes at a time: the peak stays
    a few lines, and the cause is the same."""
    import tracemalloc

    from sm121_build.core.children import LINE_WIDTH

    log = tmp_path / "build.log"
    with log.open("w") as out:
        out.write("step 1\n" + "x" * (48 << 20) + "\n")
        out.write("ptxas fatal   : error in module.ptx\nERROR: process did not complete\n")
    tracemalloc.start()
    try:
        said = failure_cause(log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert said == "ptxas said: ptxas fatal   : error in module.ptx"
    assert peak < 32 * LINE_WIDTH, f"{peak} bytes held"


class _LegacyApi:
    """FAKE: the SDK's API client of an engine without BuildKit; its build answers the
    chunks given (JSON values of any shape, as the engine's stream decodes)."""

    timeout = 60

    def __init__(self, chunks: list[object]) -> None:
        self.chunks = chunks
        self.adapters: dict[str, object] = {}

    def mount(self, *_args: object) -> None:
        pass

    def build(self, **_kwargs: object) -> list[object]:
        return self.chunks


@pytest.mark.parametrize("chunks", [
    ["a text"], [5], [None], [{"aux": "an ID in a text"}], [{"aux": {"ID": 5}}],
    [{"aux": {"ID": {"Id": "sha256:" + "a" * 64}}}], [{"aux": {"ID": "sha256:x\n\x1b[2J"}}],
    [{"aux": {"ID": "../../etc"}}], [{"stream": "Step 1/1\n"}]])
def test_a_legacy_build_gives_an_image_id_or_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[object]) -> None:
    """Red team 5: the legacy builder's chunks were trusted to be objects and its `aux.ID`
    an image ID: a chunk of another shape was a traceback, and any `ID` (a number, an
    object, a text with a newline) was returned as the built image's ID, to be tagged and
    written to the ledger (which then refuses itself as damaged).  Each is now
    BuildFailed in one line; an engine's ID is `sha256:` and 64 hex digits."""
    from types import SimpleNamespace

    from sm121_build.core.errors import BuildFailed
    from sm121_build.image.engine import Engine

    engine = Engine(SimpleNamespace(api=_LegacyApi(chunks)))
    monkeypatch.setattr(engine, "buildkit_client", lambda: None)
    with pytest.raises(BuildFailed, match="full log"):
        engine.build(tmp_path, tmp_path / "Dockerfile", tmp_path / "build.log")
    good = "sha256:" + "b" * 64
    honest = [{"stream": "Step 1/1\n"}, {"aux": {"ID": good}}]
    engine = Engine(SimpleNamespace(api=_LegacyApi(honest)))
    monkeypatch.setattr(engine, "buildkit_client", lambda: None)
    assert engine.build(tmp_path, tmp_path / "Dockerfile", tmp_path / "build.log") == good
