"""The real toolchain (nvcc, cuobjdump from PyPI), cached builds, PyPI downloads, the CLI
runner with its one-line-error check, git with a fixed identity, pyelftools' reading of
`.dynsym` (an oracle) and the benchmarks' median timing."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
CACHE = Path(os.environ.get("SM121_TEST_CACHE", ROOT / ".cache"))
# Whether this Python runs under qemu-user (an ARM64 root on an x86 host, as the tests of
# issue #55 ran): qemu catches every signal itself (so /proc's SigCgt says nothing of the
# program's handlers), refuses PR_SET_CHILD_SUBREAPER, and adds its own memory to the RSS
def _emulated() -> bool:
    """qemu-user catches every signal itself: SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 show as
    caught in /proc's status of a Python that catches none of them."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in status.splitlines()
                   if line.startswith("SigCgt:")), 0)
    return all(caught & (1 << (number - 1)) for number in (1, 3, 10, 12))


EMULATED = _emulated()
EMULATED_WHY = "under qemu-user emulation: it takes the signals, the subreaper and the memory"
# A kernel in `cuobjdump -symbols`: 13.5 prints `FUNC GLOBAL DEFAULT ENTRY name`, 13.4 and
# older (the aarch64 oracle: 13.5's needs glibc 2.38) `STT_FUNC STB_GLOBAL STO_ENTRY name`
CUOBJDUMP_ENTRY = (r"^(?:FUNC\s+\S+\s+\S+\s+ENTRY|STT_FUNC\s+\S+\s+(?:\S+\s+)?STO_ENTRY)"
                   r"\s+(\S+)$")
T = TypeVar("T")


def cuda_home() -> Path:
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda-13.0", "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            return Path(candidate)
    raise RuntimeError("nvcc not found: set CUDA_HOME (tests need the real CUDA 13 toolchain)")


def nvcc() -> str:
    return str(cuda_home() / "bin" / "nvcc")


def cuobjdump() -> str:
    """The real cuobjdump from PyPI's nvidia-cuda-cuobjdump: the oracle, tests only."""
    import nvidia

    for base in nvidia.__path__:
        for found in Path(base).glob("cu*/bin/cuobjdump"):
            return str(found)
    raise RuntimeError("cuobjdump not found: pip install nvidia-cuda-cuobjdump")


def run_cuobjdump(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([cuobjdump(), *args], capture_output=True, text=True, check=False)


_FILLING: list[int] = []  # this process holds the fill lock (depth)


@contextlib.contextmanager
def cache_fill() -> Iterator[None]:
    """One process at a time makes what the cache lacks (a promise mutant's run beside the
    suite, two checkouts sharing SM121_TEST_CACHE): an exclusive lock on CACHE/.fill.lock
    while an item is made; a caller checks for the item again once it holds it.  Re-entrant
    in a process."""
    if _FILLING:
        yield
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".fill.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _FILLING.append(1)
        try:
            yield
        finally:
            _FILLING.pop()
            fcntl.flock(lock, fcntl.LOCK_UN)


def made_once(marker: Path, make: Callable[[], object]) -> None:
    """`make()` unless `marker` (what it makes, or the file that says it is whole) exists:
    under `cache_fill`, looked for again once the lock is held."""
    if marker.exists():
        return
    with cache_fill():
        if not marker.exists():
            make()


def _nvcc_env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{cuda_home() / 'bin'}:{os.environ['PATH']}"}


def compile_cached(name: str, source: Path, flags: list[str], shared: bool = True) -> Path:
    """nvcc SOURCE into a cached .so (or .o); the key covers source, flags and nvcc."""
    key = hashlib.sha256()
    key.update(source.read_bytes())
    key.update("\0".join(flags).encode())
    key.update(nvcc().encode())
    out_dir = CACHE / "fixtures" / key.hexdigest()[:16]
    out = out_dir / (f"{name}.so" if shared else f"{name}.o")
    kind = ["-shared", "-Xcompiler", "-fPIC"] if shared else ["-c", "-Xcompiler", "-fPIC"]
    made_once(out, lambda: _nvcc_into(out, [*kind, str(source), *flags]))
    return out


def _nvcc_into(out: Path, args: list[str]) -> None:
    """nvcc ARGS into `out`, whole: a temporary name of this process's own, renamed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}{out.suffix}")  # (another process may race)
    subprocess.run([nvcc(), *args, "-o", str(tmp)], check=True, env=_nvcc_env())
    os.replace(tmp, out)


def link_cached(name: str, parts: list[tuple[Path, list[str]]]) -> Path:
    """Several sources, each compiled by nvcc with its own flags, linked into one cached .so
    (a file whose kernels differ in what code they carry, as real extensions do)."""
    key = hashlib.sha256(nvcc().encode())
    for source, flags in parts:
        key.update(source.read_bytes() + b"\0" + "\0".join(flags).encode() + b"\1")
    out = CACHE / "fixtures" / key.hexdigest()[:16] / f"{name}.so"
    made_once(out, lambda: _link(name, out, parts))
    return out


def _link(name: str, out: Path, parts: list[tuple[Path, list[str]]]) -> None:
    objects = []
    for i, (source, flags) in enumerate(parts):
        obj = out.parent / f"{name}.{i}.{os.getpid()}.o"
        _nvcc_into(obj, ["-c", "-Xcompiler", "-fPIC", str(source), *flags])
        objects.append(str(obj))
    _nvcc_into(out, ["-shared", *objects])
    for made in objects:
        Path(made).unlink()


def compile_device_file(name: str, source: Path, kind: str, flags: list[str]) -> Path:
    """nvcc SOURCE into a cached raw device file: kind `cubin`, `fatbin` or `ptx`."""
    key = hashlib.sha256(source.read_bytes() + "\0".join([kind, *flags, nvcc()]).encode())
    out = CACHE / "fixtures" / key.hexdigest()[:16] / f"{name}.{kind}"
    made_once(out, lambda: _nvcc_into(out, [f"-{kind}", str(source), *flags]))
    return out


def gencode(*pairs: str) -> list[str]:
    """'compute_90a:sm_90a' -> ['-gencode', 'arch=compute_90a,code=sm_90a']."""
    flags = []
    for pair in pairs:
        arch, code = pair.split(":")
        flags += ["-gencode", f"arch={arch},code={code}"]
    return flags


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed CLI as a user would."""
    return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                          text=True, check=False, env={**os.environ, **(env or {})})


def cli_as_nobody(*args: str, env: dict[str, str],
                  python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    """The CLI as uid and gid 65534 with no groups (setpriv; the caller is root, who reads
    every file whatever its mode), from this checkout.  That user must first be able to
    start it (`--help`): a venv or checkout under a 0700 home (`sudo bash .ci/run` from
    /root) shuts it out, and the test is skipped with one line saying so, not failed on
    the empty output of an interpreter that never ran."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to run as an unprivileged user")
    command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-m",
               "sm121_build"]
    tried = subprocess.run([*command, "--help"], capture_output=True, text=True, check=False,
                           cwd=ROOT, env=env)
    if tried.returncode != 0:
        said = (tried.stderr.strip().splitlines() or [f"exit {tried.returncode}"])[-1]
        pytest.skip(f"uid 65534 cannot start {python} -m sm121_build in {ROOT} ({said}): a "
                    "0700 folder above the venv or the checkout? Put them where that user "
                    "may read")
    return subprocess.run([*command, *args], capture_output=True, text=True, check=False,
                          cwd=ROOT, env=env)


# runs the CLI in the interpreter it is given and prints every module loaded when it ends
_LOADED = """
import runpy, sys
sys.argv = ["sm121-build", *sys.argv[1:]]
try:
    runpy.run_module("sm121_build", run_name="__main__")
except SystemExit:
    pass
print("\\n".join(sorted(sys.modules)), file=sys.stderr)
"""


def modules_loaded(*args: str) -> set[str]:
    """Every module `sm121-build ARGS` has loaded when it ends, in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", _LOADED, *args], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    return set(done.stderr.split())


def which_or_fail(name: str) -> str:
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not installed")
    return found


def pypi_download(spec: str, dest: Path, *, sdist: bool = False,
                  platform: str = "manylinux_2_31_aarch64", tags: str | None = None) -> Path:
    """Download one real artifact from PyPI once; later calls reuse the cached file.

    Sdists come straight from the simple index (pip would try to build their metadata,
    which needs torch); the file's sha256 from the index is checked.
    """
    name, _, version = spec.partition("==")
    pattern = f"{name}-{version}.tar.gz" if sdist else \
        f"{name}-{version}-*{tags or platform}*.whl"  # tags: when pip picks an older tag
    cached = sorted(dest.glob(pattern))
    if cached:
        return cached[0]
    with cache_fill():
        cached = sorted(dest.glob(pattern))
        return cached[0] if cached else _download(spec, dest, pattern, sdist, platform)


def _download(spec: str, dest: Path, pattern: str, sdist: bool, platform: str) -> Path:
    name = spec.partition("==")[0]
    dest.mkdir(parents=True, exist_ok=True)
    if sdist:
        return _simple_index_download(name, pattern, dest)
    # into a folder of its own, then renamed in: a reader never sees half a wheel
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as part:
        args = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", part, spec,
                "--only-binary", ":all:", "--platform", platform, "--python-version", "3.12"]
        subprocess.run(args, check=True)
        for got in Path(part).iterdir():
            os.replace(got, dest / got.name)
    found = sorted(dest.glob(pattern))
    if not found:
        raise RuntimeError(f"pip download {spec} produced no {pattern}")
    return found[0]


def _simple_index_download(name: str, filename: str, dest: Path) -> Path:
    import re
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    with urllib.request.urlopen(f"{index}/{name}/", timeout=60) as response:
        html = response.read().decode()
    match = re.search(rf'href="([^"]+/{re.escape(filename)})#sha256=([0-9a-f]+)"', html)
    if not match:
        raise RuntimeError(f"{filename} is not on {index}/{name}/")
    url, digest = match.groups()
    tmp = dest / (filename + ".part")
    with urllib.request.urlopen(url, timeout=300) as response, open(tmp, "wb") as out:
        shutil.copyfileobj(response, out)
    if hashlib.sha256(tmp.read_bytes()).hexdigest() != digest:
        tmp.unlink()
        raise RuntimeError(f"{filename}: sha256 mismatch")
    return tmp.rename(dest / filename)


def one_line_error(result: subprocess.CompletedProcess[str], code: int = 2,
                   alone: bool = False) -> str:
    """The run failed with `code`, said exactly one `error: …` line and no traceback
    (`alone`: and nothing else on stderr).  Returns that line."""
    stderr = result.stderr
    assert result.returncode == code, stderr
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and (not alone or lines == errors), stderr
    return errors[0]


GIT_IDENTITY = ("-c", "user.email=fixture@example.invalid", "-c", "user.name=fixture")


def git(cwd: Path, *args: str) -> str:
    """`git -C cwd ARGS` with a fixed identity; its stdout, stripped."""
    return subprocess.run(["git", "-C", str(cwd), *GIT_IDENTITY, *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def vllm_like_tree(tmp_path: Path, cmakelists: str | None = "", utils_extra: str = "",
                   **cmake_files: str) -> Path:
    """A vLLM-shaped CMake tree under tmp_path/src: the fixture's cmake/utils.cmake (vLLM's
    guard semantics, plus `utils_extra`), CMakeLists.txt (none when None) and
    cmake/NAME.cmake for each keyword (NAME may hold folders: `external/q`)."""
    source = tmp_path / "src"
    (source / "cmake").mkdir(parents=True)
    utils = (DATA / "vllm_like" / "cmake" / "utils.cmake").read_text()
    (source / "cmake" / "utils.cmake").write_text(utils + utils_extra)
    if cmakelists is not None:
        (source / "CMakeLists.txt").write_text(cmakelists)
    for name, text in cmake_files.items():
        path = source / "cmake" / f"{name}.cmake"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return source


def pyelftools_dynsym(path: Path) -> tuple[set[str], set[str]]:
    """(undefined, exported) of `.dynsym` through pyelftools' own symbol objects, one at a
    time: the reader `dynsym.dynamic_symbols` replaced (~20x slower), kept as its oracle."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    undefined, exported = set(), set()
    with open(path, "rb") as handle:
        table = ELFFile(handle).get_section_by_name(".dynsym")
        assert isinstance(table, SymbolTableSection), path
        for symbol in table.iter_symbols():
            bind = symbol["st_info"]["bind"]
            if not symbol.name or bind not in ("STB_GLOBAL", "STB_WEAK", "STB_LOOS"):
                continue
            if symbol["st_shndx"] == "SHN_UNDEF":
                if bind == "STB_GLOBAL":
                    undefined.add(symbol.name)
            elif symbol["st_other"]["visibility"] in ("STV_DEFAULT", "STV_PROTECTED"):
                exported.add(symbol.name)
    return undefined, exported


def median_timed(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """The median wall time of `repeat` (>= 1) calls of `fn` (benchmarks), and the last
    call's result."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        runs.append((time.perf_counter() - start, result))
    return statistics.median(seconds for seconds, _ in runs), runs[-1][1]


def aot_pair_of(so: Path, name: str, root: Path) -> tuple[Path, Path]:
    """(--files, --stock) for `prove`: `so` as the stock file `name` in ROOT/stock, and
    `aot` of it for sm_121 in ROOT/aot."""
    stock, made = root / "stock", root / "aot"
    stock.mkdir(parents=True)
    (stock / name).write_bytes(so.read_bytes())
    done = cli("aot", str(stock / name), "--out", str(made), "--target", "sm_121",
               env={"CUDA_HOME": str(cuda_home())})
    assert done.returncode == 0, done.stderr
    return made, stock
