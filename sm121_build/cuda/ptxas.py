"""NVIDIA's ptxas and fatbinary, found and run with time limits: what `aot` compiles with.

The same PTX, the same default optimisation and the options the entry records (which the
driver's JIT applies too) go to ptxas for the GPU; the cubin becomes a fatbin entry through
NVIDIA's own `fatbinary --compress-all` (zstd, which the driver decompresses at load).
Where they come from, first found: `--cuda-home`, `$CUDA_HOME/bin`, the `ptxas` on `PATH`,
PyPI's `nvidia-cuda-nvcc` (`nvidia/cu*/bin`, wheels for x86_64 and aarch64), `/usr/local/cuda`.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.errors import ToolchainError
from sm121_build.core.interrupts import temp_dir
from sm121_build.cuda.compat import Target, max_ptx_isa

_RELEASE = re.compile(r"release (\d+)\.(\d+), V([\d.]+)")
# ptxas options an entry may record that change nothing but what the JIT would also do
_OPTION = re.compile(r"^(-{1,2}(maxrregcount|maxntid|minnctapersm)[= ]?\d+(,\d+)*|-O[0-3]|"
                     r"-{1,2}(generate-line-info|lineinfo|verbose|v|warn-on-spills|"
                     r"warn-on-local-memory-usage|warn-on-double-precision-use|"
                     r"allow-expensive-optimizations(=true|=false)?))$")
VERSION_TIMEOUT = 60.0


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


def find_toolchain(cuda_home: Path | None = None) -> Toolchain:
    """The first folder holding both ptxas and fatbinary that answer `--version`."""
    for folder in _candidates(cuda_home):
        if (folder / "ptxas").is_file() and (folder / "fatbinary").is_file():
            return _read_version(folder)
    where = f"in {cuda_home}" if cuda_home else "in $CUDA_HOME, on PATH, in PyPI's " \
        "nvidia-cuda-nvcc or /usr/local/cuda"
    raise ToolchainError(f"no ptxas with fatbinary beside it {where}: `pip install "
                         "nvidia-cuda-nvcc` (wheels for x86_64 and aarch64) or give --cuda-home")


def _read_version(folder: Path) -> Toolchain:
    try:
        done = subprocess.run([str(folder / "ptxas"), "--version"], capture_output=True,
                              text=True, timeout=VERSION_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolchainError(f"{folder / 'ptxas'} does not run: {exc}") from None
    match = _RELEASE.search(done.stdout)
    if done.returncode or not match:
        raise ToolchainError(f"{folder / 'ptxas'} --version printed no CUDA release")
    return Toolchain(folder, (int(match.group(1)), int(match.group(2))), match.group(3))


def checked_options(recorded: str) -> list[str]:
    """The options an entry records, as ptxas arguments; any other option is refused."""
    tokens = recorded.split()
    bad = [t for t in tokens if not _OPTION.match(t)]
    if bad:
        raise ToolchainError(f"the PTX records ptxas options this tool does not pass on: "
                             f"{' '.join(bad)}")
    return tokens


def compile_ptx(toolchain: Toolchain, ptx: bytes, arch: str, options: list[str],
                timeout: float) -> bytes:
    """ptxas -arch=ARCH on the PTX text (its trailing NULs dropped): the cubin."""
    with temp_dir("sm121-aot-") as tmp:
        source, cubin = Path(tmp) / "module.ptx", Path(tmp) / "module.cubin"
        source.write_bytes(ptx.rstrip(b"\0"))
        _run([str(toolchain.ptxas), f"-arch={arch}", *options, "-o", str(cubin), str(source)],
             timeout, "ptxas")
        return cubin.read_bytes()


def fatbin_entry(toolchain: Toolchain, cubin: bytes, sm: str, timeout: float) -> bytes:
    """The cubin as one fatbin entry (header and payload), made by NVIDIA's fatbinary."""
    with temp_dir("sm121-aot-") as tmp:
        source, fatbin = Path(tmp) / "module.cubin", Path(tmp) / "module.fatbin"
        source.write_bytes(cubin)
        _run([str(toolchain.fatbinary), f"--create={fatbin}", "--64", "--compress-all",
              f"--image3=kind=elf,sm={sm},file={source}"], timeout, "fatbinary")
        data = fatbin.read_bytes()
    head, payload = struct.unpack_from("<IQ", data, 16 + 4)
    return data[16:16 + head + payload]


def _run(args: list[str], timeout: float, what: str) -> None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ToolchainError(f"{what} ran past its {timeout:.0f} s limit") from None
    except OSError as exc:
        raise ToolchainError(f"{what} does not run: {exc}") from None
    if done.returncode:
        said = " ".join((done.stderr or done.stdout).split())[:300]
        raise ToolchainError(f"{what} failed (exit {done.returncode}): {said}")


def arch_for(target: Target, variant: str) -> str:
    """ptxas's -arch for the GPU: `sm_121`, or `sm_90a` for arch-specific PTX."""
    return f"sm_{target.arch}{'a' if variant == 'a' else ''}"
