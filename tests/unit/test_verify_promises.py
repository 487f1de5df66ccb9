"""Each promise README makes about verification, broken on purpose, through the whole main
job (`run_build` -> `Pipeline.build_verify_tag` -> `verify_image`) on the FAKE engine with real
files: the run must fail with exit 3, tag nothing, remove the image it built, and name the
cause in its one line.  Each test also has an unbroken twin (the same run passing), so none can
pass by failing for another reason.

The files are real: nvcc-built .so files whose kernels carry different code (tests/data/
promises), a gcc-built torch library exporting what the extensions need, and image configs
changed the way a template or builder that did more than copy the files would change them
(`FakeEngine.tamper`)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from devkit.fakeengine import SITE, FakeEngine, FakeImage, stock_image
from devkit.helpers import DATA, gencode, link_cached
from devkit.stockimage import VERSION
from sm121_build.core.errors import VerificationError
from sm121_build.cuda.compat import ArchList
from sm121_build.image.api import RUNTIME_FIELDS, HistoryStep
from sm121_build.jobs.framework import run_record
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.jobs.main_run.main_job import run_build
from sm121_build.jobs.main_run.main_plan import Options

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

BASE = "vllm/vllm-openai:fixture"
TAG = "vllm/vllm-openai:fixture-sm121"
PROMISES = DATA / "promises"
NAMES = ("_C.abi3.so", "_moe_C.abi3.so")
TORCH_NEEDS = {  # what torch_user.cpp needs, by kind
    "function": "_ZN3c1013MessageLoggerC1EPKciib",
    "vtable": "_ZTVN3c1011StorageImplE",
    "typeinfo": "_ZTIN2at6TensorE",
    "stable shim": "aoti_torch_get_device_index",
}


pytestmark = pytest.mark.usefixtures("isolated_cache")


@pytest.fixture(scope="module")
def files() -> dict[str, Path]:
    """stock: both kernel families native on sm_90.  built: kernels.cu native on sm_121 and
    extra.cu as the variant says.  Every built file also needs torch (torch_user.cpp)."""
    kernels, extra, host = DATA / "kernels.cu", PROMISES / "extra.cu", PROMISES / "torch_user.cpp"
    sm90, sm121 = gencode("compute_90:sm_90"), gencode("compute_121:sm_121")
    return {
        "stock": link_cached("stock", [(kernels, sm90), (extra, sm90)]),
        # stub.cu: real code on sm_90, a trap-only stub on sm_120 (which sm_121 loads)
        "stock-stub": link_cached("stock-stub", [
            (kernels, sm90), (extra, sm90),
            (PROMISES / "stub.cu", gencode("compute_90:sm_90", "compute_120:sm_120"))]),
        # the same kernel with its real body on sm_120 too: no stub
        "stock-real": link_cached("stock-real", [
            (kernels, sm90), (extra, sm90),
            (PROMISES / "stub.cu", [*gencode("compute_90:sm_90", "compute_120:sm_120"),
                                    "-DREAL_EVERYWHERE"])]),
        # extra.cu as PTX only: sm_121 runs it through the JIT
        "stock-jit": link_cached("stock-jit", [(kernels, sm90),
                                               (extra, gencode("compute_90:compute_90"))]),
        "built": link_cached("built", [(kernels, sm121), (extra, sm121), (host, [])]),
        # extra.cu only as PTX: the driver would JIT it on sm_121; the stock had it native
        "built-jit": link_cached("built-jit", [(kernels, sm121),
                                               (extra, gencode("compute_90:compute_90")),
                                               (host, [])]),
        "built-lost": link_cached("built-lost", [(kernels, sm121), (host, [])]),
    }


def torch_library(folder: Path, leave_out: str | None = None) -> Path:
    """A real shared library exporting what torch_user.cpp needs (but `leave_out`)."""
    source = folder / "torch_lib.c"
    lines = []
    for i, symbol in enumerate(s for s in TORCH_NEEDS.values() if s != leave_out):
        lines.append(f'char exported_{i}[8] __asm__("{symbol}");')
    source.write_text("\n".join(lines) + "\n")
    out = folder / "libc10.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out


def _engine(tmp_path: Path, files: dict[str, Path], commit: str, built: str = "built",
            leave_out: str | None = None, stock: str = "stock",
            tamper: Callable[[FakeImage], None] | None = None) -> FakeEngine:
    engine = FakeEngine(tmp_path / "engine", compiled={n: files[built] for n in NAMES},
                        tamper=tamper)
    engine.work.mkdir()
    torch_lib = torch_library(tmp_path, leave_out)
    stock_image(engine, BASE, {n: files[stock] for n in NAMES}, VERSION, commit,
                extra={f"{SITE}/torch/lib/libc10.so": torch_lib})
    return engine


def _run(engine: FakeEngine, source: Path) -> run_record.RunRecord:
    opts = Options(base=BASE, tag=TAG, arch=ARCHS_121, extra_ext=(), jobs=2,
                   source=source,
                   repo="/nonexistent", out=None, force=True, no_patch=True)
    record = run_record.new_record("build", BASE, TAG, ARCHS_121)
    with run_record.recorded(record, None, None):
        run_build(Pipeline(engine, record), opts)
    return record


def _fails(engine: FakeEngine, source: Path, cause: str) -> str:
    """The run fails verification (exit 3) naming `cause` in its line; nothing tagged, the
    image it built removed."""
    before = set(engine.images)
    with pytest.raises(VerificationError) as failed:
        _run(engine, source)
    assert failed.value.exit_code == 3
    line = str(failed.value)
    assert line.startswith("verification failed: ") and line.endswith("not tagged")
    assert cause in line, line
    assert TAG not in engine.tags and set(engine.images) == before
    assert any(c.startswith("build ") for c in engine.calls)  # it got as far as verifying
    return line


def test_the_unbroken_run_passes(tmp_path: Path, files: dict[str, Path],
                                 checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, files, checkout[1])
    record = _run(engine, checkout[0])
    assert record.status == "built" and engine.tags[TAG] == record.image_id
    assert record.abi_symbols_checked == 2 * len(TORCH_NEEDS)
    assert record.after and record.after["_C.abi3.so"].kernels == {
        "native": 5, "jit": 0, "none": 0}


# -- every stock kernel native by name -----------------------------------------------------
def test_a_kernel_the_build_has_only_as_ptx_is_not_native(
        tmp_path: Path, files: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """The stock file has extra_kernel as sm_90 SASS; the build only as PTX (JIT on sm_121):
    a kernel that was native must stay native."""
    engine = _engine(tmp_path, files, checkout[1], built="built-jit")
    line = _fails(engine, checkout[0], "_C.abi3.so: kernel _ZN4vllm12extra_kernelEPfi has "
                  "native sm_90 code in the stock image but none for sm_121 in the build")
    assert "(+1 more" in line  # _moe_C.abi3.so too


def test_a_kernel_the_build_lacks_fails_the_run(
        tmp_path: Path, files: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, files, checkout[1], built="built-lost")
    _fails(engine, checkout[0], "kernel _ZN4vllm12extra_kernelEPfi has native sm_90 code")


def test_a_kernel_the_stock_could_jit_must_still_load(
        tmp_path: Path, files: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """The stock file has extra_kernel as PTX only (slow, but it runs on sm_121); a build
    without it would turn a slow kernel into a missing one."""
    engine = _engine(tmp_path, files, checkout[1], built="built-lost", stock="stock-jit")
    _fails(engine, checkout[0], "_C.abi3.so: kernel _ZN4vllm12extra_kernelEPfi loads on sm_121 "
                                "from the stock file (jit) but not from the build")
    (tmp_path / "twin").mkdir()
    engine = _engine(tmp_path / "twin", files, checkout[1], stock="stock-jit")
    assert _run(engine, checkout[0]).status == "built"


def test_a_kernel_that_was_a_stub_on_sm_121_may_be_left_out(
        tmp_path: Path, files: dict[str, Path], checkout: tuple[Path, str],
        capfd: pytest.CaptureFixture[str], matrix: dict[str, Path]) -> None:
    """The stock file's sm_120 code for sm90_only_kernel only traps (its real code is the
    sm_90 cubin, many times larger): a build without it loses nothing, and says so.  The
    same kernel with a real sm_120 body must stay."""
    from sm121_build.cuda.compat import DEFAULT_TARGET
    from sm121_build.verify.checks import Stub, cubins_of, stubs_of

    def stub_kernels(path: Path) -> dict[str, Stub]:
        return stubs_of(cubins_of(path), DEFAULT_TARGET)

    stubs = stub_kernels(files["stock-stub"])
    assert list(stubs) == ["_ZN4vllm16sm90_only_kernelEPfPKfi"]
    stub = stubs["_ZN4vllm16sm90_only_kernelEPfPKfi"]
    assert (stub.sm, stub.implemented) == ("sm_120", "sm_90") and stub.size <= 512
    assert stub_kernels(files["stock-real"]) == {}
    # small real kernels, compiled for many archs at about one size each: no stubs
    assert stub_kernels(matrix["plain"]) == {}
    engine = _engine(tmp_path, files, checkout[1], stock="stock-stub")
    assert _run(engine, checkout[0]).status == "built"
    assert "1 kernel(s) left out that were stubs on sm_121 in the stock file, e.g. " \
           "_ZN4vllm16sm90_only_kernelEPfPKfi" in capfd.readouterr().err
    (tmp_path / "real").mkdir()
    engine = _engine(tmp_path / "real", files, checkout[1], stock="stock-real")
    _fails(engine, checkout[0], "kernel _ZN4vllm16sm90_only_kernelEPfPKfi has native sm_120 "
                                "code in the stock image but none for sm_121 in the build")


# -- nothing but copies of the injected files added ---------------------------------------
def _added_step(image: FakeImage) -> None:
    image.history.insert(0, HistoryStep("RUN /bin/sh -c rm -rf /root/.cache", 4096))
    image.info = replace(image.info, layers=(*image.info.layers, "sha256:" + "9" * 64))


def _copy_of_another_size(image: FakeImage) -> None:
    at = next(i for i, s in enumerate(image.history) if s.created_by.startswith("COPY "))
    step = image.history[at]
    image.history[at] = HistoryStep(step.created_by, step.size + 1)


@pytest.mark.parametrize(("tamper", "cause"), [
    (_added_step, "drift: added step 'RUN /bin/sh -c rm -rf /root/.cache' (4096 bytes) is not "
                  "a copy of one injected file"),
    (_copy_of_another_size, "is not a copy of one injected file"),
])
def test_anything_but_copies_of_the_injected_files_fails(
        tmp_path: Path, files: dict[str, Path], checkout: tuple[Path, str],
        tamper: Callable[[FakeImage], None], cause: str) -> None:
    engine = _engine(tmp_path, files, checkout[1], tamper=tamper)
    _fails(engine, checkout[0], cause)


# -- the runtime config unchanged ---------------------------------------------------------
def _config(field: str, value: str) -> Callable[[FakeImage], None]:
    def tamper(image: FakeImage) -> None:
        info = image.info
        if field == "env":
            image.info = replace(info, env=(*info.env, value))
        elif field == "labels":
            image.info = replace(info, labels={**info.labels, **json.loads(value)})
        else:
            runtime = list(info.runtime)
            runtime[[name for _key, name in RUNTIME_FIELDS].index(field)] = value
            image.info = replace(info, runtime=tuple(runtime))
    return tamper


@pytest.mark.parametrize(("field", "value", "cause"), [
    ("env", "LD_PRELOAD=/tmp/x.so",
     "drift: env differs from the stock image (+LD_PRELOAD=/tmp/x.so)"),
    ("entrypoint", '["/bin/sh"]', 'drift: entrypoint is ["/bin/sh"] in the built image, '
                                  '["vllm", "serve"] in the stock image'),
    ("cmd", '["--help"]', 'drift: cmd is ["--help"] in the built image, null'),
    ("workdir", '"/tmp"', 'drift: workdir is "/tmp" in the built image, "" in the stock'),
    ("user", '"nobody"', 'drift: user is "nobody" in the built image'),
    ("exposed ports", '{"22/tcp": {}}', 'drift: exposed ports is {"22/tcp": {}} in the built'),
    ("labels", '{"maintainer": "someone else"}',
     "drift: label maintainer is 'someone else' in the built image, None in the stock image"),
])
def test_a_changed_runtime_config_fails(
        tmp_path: Path, files: dict[str, Path], checkout: tuple[Path, str], field: str,
        value: str, cause: str) -> None:
    engine = _engine(tmp_path, files, checkout[1], tamper=_config(field, value))
    _fails(engine, checkout[0], cause)


def test_our_own_labels_are_no_drift(tmp_path: Path, files: dict[str, Path],
                                     checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, files, checkout[1], tamper=_config(
        "labels", '{"org.opencontainers.image.base.name": "x", '
                  '"io.github.sm121-build.anything": "y"}'))
    assert _run(engine, checkout[0]).status == "built"


# -- every torch symbol, vtable, typeinfo and stable-shim call resolved --------------------
@pytest.mark.parametrize("kind", list(TORCH_NEEDS))
def test_a_torch_symbol_the_image_does_not_export_fails(
        tmp_path: Path, files: dict[str, Path], checkout: tuple[Path, str], kind: str) -> None:
    engine = _engine(tmp_path, files, checkout[1], leave_out=TORCH_NEEDS[kind])
    line = _fails(engine, checkout[0], "ABI: _C.abi3.so needs 1 torch symbol(s) the image's "
                  "torch 2.11.0+cu130 does not export, e.g. ")
    assert TORCH_NEEDS[kind] in line


# -- vLLM version and commit equal --------------------------------------------------------
@pytest.mark.parametrize(("version", "commit"), [(VERSION, "f" * 40), ("9.9.9", None)])
def test_another_vllm_in_the_built_image_fails(
        tmp_path: Path, files: dict[str, Path], checkout: tuple[Path, str], version: str,
        commit: str | None) -> None:
    def other_vllm(image: FakeImage) -> None:
        path = image.root / SITE.lstrip("/") / "vllm/_version.py"
        path.write_text(f"__version__ = version = {version!r}\n"
                        f"__commit_id__ = {commit or checkout[1]!r}\n")

    engine = _engine(tmp_path, files, checkout[1], tamper=other_vllm)
    _fails(engine, checkout[0], f"vLLM in the built image is {version} ({commit or checkout[1]})"
                                f", the stock image has {VERSION} ({checkout[1]})")
