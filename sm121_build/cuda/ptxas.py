"""NVIDIA's ptxas and fatbinary, found and run with time limits: what `aot` compiles with.

The same PTX, the same default optimisation and the options the entry records (which the
driver's JIT applies too) go to ptxas for the GPU; the cubin becomes a fatbin entry through
NVIDIA's own `fatbinary --compress-all` (zstd, which the driver decompresses at load).
Which: `--cuda-home` when given; else the newest release among `$CUDA_HOME/bin`, the
`ptxas` on `PATH`, PyPI's `nvidia-cuda-nvcc` (`nvidia/cu*/bin`, wheels for x86_64 and
aarch64; `pip install 'sm121-build[cuda]'`) and `/usr/local/cuda` (the first found among
equals).  The newest reads every PTX ISA an older one does, and its cubins load under
older drivers of the same major (ptxas 13.5's under a CUDA 13.0 driver: measured,
docs/guide/aot.md), while the first found (DGX OS puts CUDA 13.0 in `/usr/local/cuda`) may
not read a newer image's PTX.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.children import Ended, Program, run
from sm121_build.core.errors import ToolchainError
from sm121_build.core.inputs import InputRefused, read_input
from sm121_build.core.interrupts import temp_dir
from sm121_build.cuda.compat import Target, max_ptx_isa, ptx_isa_table

_RELEASE = re.compile(r"release (\d+)\.(\d+), V([\d.]+)")
# ptxas options an entry may record that change nothing but what the JIT would also do
_OPTION = re.compile(r"^(-{1,2}(maxrregcount|maxntid|minnctapersm)[= ]?\d+(,\d+)*|-O[0-3]|"
                     r"-{1,2}(generate-line-info|lineinfo|verbose|v|warn-on-spills|"
                     r"warn-on-local-memory-usage|warn-on-double-precision-use|"
                     r"allow-expensive-optimizations(=true|=false)?))$")
VERSION_TIMEOUT = 30.0  # `ptxas --version`: milliseconds when it works
# What a tool's output may hold: a cubin or fatbin is smaller than the PTX or cubin it comes
# from, give or take; this many times its input and no less than the floor, else refused
# (a ptxas that writes gigabytes is read no further than its size)
OUTPUT_TIMES = 8
OUTPUT_FLOOR = 256 << 20


@dataclass(frozen=True)
class Toolchain:
    bin: Path
    release: tuple[int, int]  # 13.0
    version: str  # 13.0.88

    @property
    def ptxas(self) -> Path:
        return self.bin / "ptxas"

    @property
    def fatbinary(self) -> Path:
        return self.bin / "fatbinary"

    @property
    def release_key(self) -> tuple[int, ...]:
        """`13.0.88` as (13, 0, 88): newer sorts later."""
        return tuple(int(p) for p in self.version.split(".") if p.isdigit())

    @property
    def newest_isa(self) -> tuple[int, int]:
        """The newest PTX ISA this ptxas reads (the table the driver rules use)."""
        return max_ptx_isa(self.release) or (99, 9)

    def __str__(self) -> str:
        return f"ptxas {self.version} ({self.bin})"


def _candidates(cuda_home: Path | None) -> list[Path]:
    found: list[Path] = []
    if cuda_home is not None:
        return [cuda_home / "bin", cuda_home]
    if os.environ.get("CUDA_HOME"):
        found.append(Path(os.environ["CUDA_HOME"]) / "bin")
    on_path = shutil.which("ptxas")
    if on_path:
        found.append(Path(on_path).resolve().parent)
    try:
        import nvidia  # type: ignore[import-untyped]  # PyPI's namespace package: no code

        for base in getattr(nvidia, "__path__", []):
            found.extend(sorted(Path(base).glob("cu*/bin"), reverse=True))
    except ImportError:
        pass
    found.append(Path("/usr/local/cuda/bin"))
    return found


def ptxas_folders() -> list[Path]:
    """The folders aot looks in for ptxas when no --cuda-home is given, in that order."""
    return _candidates(None)


INSTALL_HINT = "pip install 'sm121-build[cuda]'"  # PyPI's ptxas and fatbinary, newest


def toolchains(cuda_home: Path | None = None) -> list[Toolchain]:
    """Every folder holding both ptxas and fatbinary that answers `--version`, in the order
    they were looked for (one folder once, however it was reached)."""
    found: list[Toolchain] = []
    seen: set[Path] = set()
    for folder in _candidates(cuda_home):
        if not ((folder / "ptxas").is_file() and (folder / "fatbinary").is_file()):
            continue
        real = folder.resolve()
        if real in seen:
            continue
        seen.add(real)
        try:
            found.append(_read_version(folder))
        except ToolchainError:
            if cuda_home is not None:
                raise
    return found


def find_toolchain(cuda_home: Path | None = None) -> Toolchain:
    """`--cuda-home`'s ptxas when given, else the newest one found (`toolchains`)."""
    found = toolchains(cuda_home)
    if found:
        return max(found, key=lambda t: t.release_key)  # the first among equals
    where = f"in {cuda_home}" if cuda_home else "in $CUDA_HOME, on PATH, in PyPI's " \
        "nvidia-cuda-nvcc or /usr/local/cuda"
    raise ToolchainError(f"no ptxas with fatbinary beside it {where}: `{INSTALL_HINT}` "
                         "(PyPI's nvidia-cuda-nvcc, for x86_64 and aarch64) or give "
                         "--cuda-home")


def newer_isa_words(isa: tuple[int, int], toolchain: Toolchain) -> str:
    """Why a module is not compiled when its PTX is newer than the newest ptxas found reads,
    and the one command that fixes it.  Never "left JIT-only": a driver older than the PTX
    cannot JIT it either."""
    release = isa_release(isa)
    return (f"its PTX is ISA {isa[0]}.{isa[1]}, which needs {release}'s ptxas or newer; the "
            f"newest found is {toolchain}: `{INSTALL_HINT}` brings NVIDIA's newest ptxas "
            f"(or give --cuda-home); left as it was, and a driver older than {release} "
            "cannot JIT it either")


def isa_release(isa: tuple[int, int]) -> str:
    """The oldest CUDA release whose ptxas (and driver) reads PTX ISA `isa`."""
    table = ptx_isa_table()
    fits = [cuda for cuda, newest in table.items() if newest >= isa]
    if not fits:
        return f"newer than CUDA {max(table)[0]}.{max(table)[1]}"
    oldest = min(fits)
    return f"CUDA {oldest[0]}.{oldest[1]}"


def _read_version(folder: Path) -> Toolchain:
    ptxas = folder / "ptxas"
    try:
        done = run(Program((str(ptxas), "--version"), VERSION_TIMEOUT, "ptxas --version"))
    except OSError as exc:
        raise ToolchainError(f"{ptxas} does not run: {exc}") from None
    match = _RELEASE.search(done.text)
    if done.timed_out:
        raise ToolchainError(f"{ptxas} --version gave no answer in {VERSION_TIMEOUT:.0f} s")
    if done.returncode or not match:
        raise ToolchainError(f"{ptxas} --version printed no CUDA release")
    return Toolchain(folder, (int(match.group(1)), int(match.group(2))), match.group(3))


def checked_options(recorded: str) -> list[str]:
    """The options an entry records, as ptxas arguments; any other option is refused."""
    tokens = recorded.split()
    bad = [t for t in tokens if not _OPTION.match(t)]
    if bad:
        raise ToolchainError(f"the PTX records ptxas options this tool does not pass on: "
                             f"{' '.join(bad)}")
    return tokens


@dataclass(frozen=True)
class PtxasRun:
    """How one ptxas call went: its cubin, and what the process alone used (its own rusage,
    not the machine's: a shared machine does not inflate it)."""

    cubin: bytes
    cpu_seconds: float
    peak_rss: int  # bytes


@dataclass(frozen=True)
class Compile:
    """One ptxas call: the GPU (`sm_121`), the options the entry records, the threads of
    `--split-compile` (1: none; the code is the same either way, shown by a test on vLLM's
    PTX), and its time limit."""

    arch: str
    options: tuple[str, ...] = ()
    threads: int = 1
    timeout: float = 3600.0

    def args(self, source: Path, cubin: Path) -> list[str]:
        split = [f"--split-compile={self.threads}"] if self.threads > 1 else []
        return [f"-arch={self.arch}", *self.options, *split, "-o", str(cubin), str(source)]


def compile_ptx(toolchain: Toolchain, ptx: bytes, sm: str, options: list[str],
                timeout: float) -> bytes:
    """ptxas -arch=SM on the PTX text (its trailing NULs dropped): the cubin.  `sm` is one
    GPU in ptxas's form, as `arch_for` writes it (`sm_121`, `sm_90a`), not an arch list."""
    return run_ptxas(toolchain, ptx, Compile(sm, tuple(options), 1, timeout)).cubin


def run_ptxas(toolchain: Toolchain, ptx: bytes, how: Compile) -> PtxasRun:
    """ptxas on the PTX text (its trailing NULs dropped), as `how` says: the cubin and the
    CPU time and peak memory of that process (and of what it started)."""
    with temp_dir("sm121-aot-") as tmp:
        source, cubin = Path(tmp) / "module.ptx", Path(tmp) / "module.cubin"
        source.write_bytes(ptx.rstrip(b"\0"))
        done = _run(Program((str(toolchain.ptxas), *how.args(source, cubin)), how.timeout,
                            "ptxas", merge=True))
        return PtxasRun(_written(cubin, "ptxas", "cubin", len(ptx)), done.cpu_seconds,
                        done.peak_rss)


def fatbin_entry(toolchain: Toolchain, cubin: bytes, sm: str, timeout: float) -> bytes:
    """The cubin as one fatbin entry (header and payload), made by NVIDIA's fatbinary."""
    with temp_dir("sm121-aot-") as tmp:
        source, fatbin = Path(tmp) / "module.cubin", Path(tmp) / "module.fatbin"
        source.write_bytes(cubin)
        _run(Program((str(toolchain.fatbinary), f"--create={fatbin}", "--64",
                      "--compress-all", f"--image3=kind=elf,sm={sm},file={source}"),
                     timeout, "fatbinary"))
        data = _written(fatbin, "fatbinary", "fatbin", len(cubin))
    if len(data) < 16 + 4 + 12:
        raise ToolchainError(f"fatbinary wrote a fatbin of {len(data)} bytes: too short")
    head, payload = struct.unpack_from("<IQ", data, 16 + 4)
    return data[16:16 + head + payload]


def _run(program: Program) -> Ended:
    """Run one of NVIDIA's tools: its end, or the one error that says how it failed."""
    try:
        done = run(program)
    except OSError as exc:
        raise ToolchainError(f"{program.what} does not run: {exc}") from None
    if done.timed_out:
        raise ToolchainError(f"{program.what} ran past its {program.seconds:.0f} s limit")
    if done.returncode:
        raise ToolchainError(f"{program.what} failed (exit {done.returncode}): "
                             f"{done.said()}")
    return done


def _written(path: Path, what: str, kind: str, given: int) -> bytes:
    """The file a tool was to write (read through the door, at most `OUTPUT_TIMES` its
    input's `given` bytes), or the error that says it exited 0 and wrote none."""
    data = b""
    if os.path.lexists(path):
        try:
            data = read_input(path, max(OUTPUT_TIMES * given, OUTPUT_FLOOR),
                              f"{what}'s {kind}")
        except InputRefused as exc:
            raise ToolchainError(str(exc).removeprefix(f"{path}: ")) from None
    if not data:
        raise ToolchainError(f"{what} exited 0 and wrote no {kind}")
    return data


def arch_for(target: Target, variant: str) -> str:
    """ptxas's -arch for the GPU: `sm_121`, or `sm_90a` for arch-specific PTX."""
    return f"sm_{target.arch}{'a' if variant == 'a' else ''}"
