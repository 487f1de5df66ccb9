"""Which fatbin entries a GPU can load: CUDA's binary-compatibility rules, written once.

References (CUDA C++ Programming Guide and PTX ISA):
- Binary compatibility: "a cubin object generated for compute capability X.y will only
  execute on devices of compute capability X.z where z >= y".
  https://docs.nvidia.com/cuda/cuda-c-programming-guide/#binary-compatibility
- Arch-specific targets (`sm_90a`, `sm_121a`): "code compiled for sm_XYa only runs on
  devices of exactly compute capability X.Y"; no forward compatibility, for cubin or PTX.
- Family-specific targets (`sm_100f`, `sm_120f`, CUDA 12.9+): run on devices of the same
  family (same major) with an equal or higher minor.
  https://docs.nvidia.com/cuda/cuda-c-programming-guide/#feature-availability
- PTX is JIT-compiled by the driver for any device of an equal or higher compute
  capability, provided the driver knows the PTX ISA version (else
  cudaErrorUnsupportedPtxVersion). https://docs.nvidia.com/cuda/parallel-thread-execution/
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal, Protocol

import yaml

from sm121_build.core.console import cut
from sm121_build.core.errors import Sm121Error

DEFAULT_CUDA = "13.0"  # the CUDA toolkit a build assumes where the image does not say

Verdict = Literal["native", "jit", "none"]
VERDICT_RANK: dict[Verdict, int] = {"none": 0, "jit": 1, "native": 2}


@dataclass(frozen=True)
class GpuFacts:
    """What the GPU table (`data/gpus.yaml`) says of one GPU."""

    name: str  # what it is: "Blackwell (GB10, DGX Spark)"
    first_cuda: str | None = None  # the first CUDA whose ptxas compiles for it
    default: bool = False  # the GPU a run serves unless --gpu names another
    machine: str = ""  # how a run names it ("a DGX Spark's GB10"); the default's alone
    driver: tuple[int, int] | None = None  # the oldest driver it ships with
    platform: str = ""  # what its images run on (linux/arm64)
    source_rules: bool = False  # the guard rules (patches/) are written for it
    shared_memory: tuple[int, int] | None = None  # bytes: per block (opt-in), per SM


def _gpu_table() -> dict[str, GpuFacts]:
    raw = yaml.safe_load(resources.files("sm121_build").joinpath("data/gpus.yaml").read_text())
    table = {}
    for arch, row in raw.items():
        driver = tuple(int(part) for part in row["driver"].split(".")) if "driver" in row \
            else None
        memory = row.get("shared_memory")
        table[str(arch)] = GpuFacts(row["name"], row.get("first_cuda"),
                                    bool(row.get("default")), row.get("machine", ""),
                                    (driver[0], driver[1]) if driver else None,
                                    row.get("platform", ""), bool(row.get("source_rules")),
                                    (int(memory[0]), int(memory[1])) if memory else None)
    defaults = [arch for arch, facts in table.items() if facts.default]
    if len(defaults) != 1 or table[defaults[0]].driver is None:
        raise RuntimeError("data/gpus.yaml: exactly one GPU is the default, with its driver")
    return table


# CUDA's real architectures, as TORCH_CUDA_ARCH_LIST spells them: the one table of GPUs a
# value given to any command (an arch list, --gpu, --target) may name, and what is known of
# each; data (`data/gpus.yaml`), read once here.
GPU_TABLE = _gpu_table()
KNOWN_ARCHS = frozenset(GPU_TABLE)
# ASCII digits only: `\d` alone takes `sm_١٢١` (Arabic-Indic) or fullwidth digits too
_TARGET = re.compile(r"^(?:sm_|compute_)?(\d{2,3})([af]?)$", re.ASCII)
_DOTTED = re.compile(r"^(\d{1,2})\.(\d)([af]?)$", re.ASCII)


@dataclass(frozen=True)
class Target:
    """A GPU to run on, by compute capability (`sm_121` is 12.1)."""

    arch: int

    @property
    def major(self) -> int:
        return self.arch // 10

    @property
    def minor(self) -> int:
        return self.arch % 10

    @property
    def facts(self) -> GpuFacts:
        """What the GPU table says of it (a name alone for a GPU it does not list)."""
        return GPU_TABLE.get(f"{self.major}.{self.minor}", GpuFacts(str(self)))

    @property
    def is_default(self) -> bool:
        """The GPU a run serves unless --gpu names another (a DGX Spark's)."""
        return self.facts.default

    @property
    def has_source_rules(self) -> bool:
        """Whether the guard rules (patches/) are written for it: a source build is for it
        alone; any other GPU gets aot only."""
        return self.facts.source_rules

    @property
    def dotted(self) -> str:
        """As an arch list writes it: `12.1`."""
        return f"{self.major}.{self.minor}"

    def __str__(self) -> str:
        return f"sm_{self.arch}"


class Code(Protocol):
    """What decides whether a fatbin entry loads: its kind, arch, variant and version (a
    fatbin's `Entry`)."""

    @property
    def kind(self) -> str: ...
    @property
    def arch(self) -> int: ...
    @property
    def variant(self) -> str: ...
    @property
    def version(self) -> tuple[int, int]: ...


def known_in_order() -> list[str]:
    """The GPU table's compute capabilities, oldest first (`7.5`, ..., `12.1`)."""
    return sorted(KNOWN_ARCHS, key=lambda dotted: tuple(map(int, dotted.split("."))))


def parse_target(text: str) -> Target:
    """`sm_121`, `121`, `12.1` (a device has no `a`/`f` variant; one given is ignored), one of
    `KNOWN_ARCHS`: a GPU no CUDA toolkit knows is refused here, not by ptxas per module."""
    value = text.strip().lower()
    match = _TARGET.match(value)
    arch = int(match.group(1)) if match else 0
    match = _DOTTED.match(value)
    if match:
        arch = int(match.group(1)) * 10 + int(match.group(2))
    if f"{arch // 10}.{arch % 10}" in KNOWN_ARCHS:
        return Target(arch)
    known = ", ".join(f"sm_{a.replace('.', '')}" for a in known_in_order())
    raise Sm121Error(f"unknown GPU target {cut(text)!r}: expected e.g. sm_121, 121 or 12.1 "
                     f"(known: {known})")


def arch_list_items(text: str) -> list[str]:
    """The entries of a TORCH_CUDA_ARCH_LIST (`12.1`, `9.0 12.1a`, `8.0+PTX;12.1`)."""
    return [a for a in re.split(r"[;\s,]+", text.strip()) if a]


@dataclass(frozen=True)
class ArchList:
    """An arch list in both its forms: as the user and torch write it (TORCH_CUDA_ARCH_LIST:
    `12.1`, `9.0 12.1a`, `8.0+PTX;12.1`) and as vLLM's CMake takes it (`9.0;12.1a`: `;`
    separated, `+PTX` dropped)."""

    torch: str  # `;`-separated once parsed: one spelling in every file and label

    @classmethod
    def parse(cls, text: str) -> ArchList:
        """Parsed once at the edge; `,`, spaces and `;` all separate."""
        items = arch_list_items(text)
        for item in items:
            if not re.fullmatch(r"\d{1,2}\.\d[af]?(\+PTX)?", item, re.ASCII):
                raise Sm121Error(f"unknown arch {item!r} in {text!r}: expected e.g. 12.1 or "
                                 "12.1a")
        return cls(";".join(items))

    @property
    def items(self) -> tuple[str, ...]:
        return tuple(arch_list_items(self.torch))

    @property
    def cmake_items(self) -> tuple[str, ...]:
        """The entries in vLLM's CMake form: `+PTX` dropped (`8.0+PTX` -> `8.0`)."""
        return tuple(i.replace("+PTX", "") for i in self.items)

    @property
    def cmake(self) -> str:
        """vLLM's CMake form (CUDA_ARCHS): `;`-separated, `+PTX` dropped."""
        return ";".join(self.cmake_items)

    @property
    def tag(self) -> str:
        """The form a kernels image's pinned tag carries: `sm120f-sm121`."""
        return "-".join("sm" + a.replace(".", "") for a in self.items)

    def __str__(self) -> str:
        return self.torch


def dotted_arch(text: str) -> tuple[int, str] | None:
    """(arch, variant) of a CMake/TORCH_CUDA_ARCH_LIST entry: `12.0f` -> (120, "f")."""
    match = _DOTTED.match(text)
    return (int(match.group(1)) * 10 + int(match.group(2)), match.group(3)) if match else None


def parse_cuda_version(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d+)", text.strip(), re.ASCII)
    if not match:
        raise Sm121Error(f"unknown CUDA driver version {text!r}: expected e.g. 13.0")
    return int(match.group(1)), int(match.group(2))


@cache
def ptx_isa_table() -> dict[tuple[int, int], tuple[int, int]]:
    """CUDA release -> the newest PTX ISA its driver JITs (and its ptxas reads)."""
    raw = yaml.safe_load(resources.files("sm121_build").joinpath("data/ptx_isa.yaml").read_text())
    return {parse_cuda_version(k): parse_cuda_version(v) for k, v in raw.items()}


def max_ptx_isa(driver: tuple[int, int]) -> tuple[int, int] | None:
    """The newest PTX ISA a driver JITs; None when the driver is newer than the table."""
    table = ptx_isa_table()
    if driver > max(table):
        return None
    known = [cuda for cuda in table if cuda <= driver]
    if not known:
        raise Sm121Error(f"CUDA driver {driver[0]}.{driver[1]} is older than CUDA 11.0")
    return table[max(known)]


def cubin_loads(arch: int, variant: str, target: Target) -> bool:
    if variant == "a":
        return arch == target.arch
    return arch // 10 == target.major and arch % 10 <= target.minor


def loads_natively(target: str, gpu: Target) -> bool:
    """Whether a CMake arch entry (`12.0f`, `12.0a`, `12.1`) gives cubins `gpu` loads."""
    parsed = dotted_arch(target.replace("+PTX", ""))
    return parsed is not None and cubin_loads(*parsed, gpu)


def ptx_loads(arch: int, variant: str, isa: tuple[int, int], target: Target,
              driver: tuple[int, int]) -> bool:
    newest = max_ptx_isa(driver)
    if newest is not None and isa > newest:
        return False
    if variant == "a":
        return arch == target.arch
    if variant == "f":
        return arch // 10 == target.major and arch % 10 <= target.minor
    return (arch // 10, arch % 10) <= (target.major, target.minor)


def entry_verdict(code: Code, target: Target, driver: tuple[int, int]) -> Verdict:
    """What one fatbin entry gives the target: native code, JIT from PTX, or nothing."""
    if code.kind == "elf":
        return "native" if cubin_loads(code.arch, code.variant, target) else "none"
    if code.kind == "ptx":
        return "jit" if ptx_loads(code.arch, code.variant, code.version, target,
                                  driver) else "none"
    return "none"


def best(verdicts: list[Verdict]) -> Verdict:
    return max(verdicts, key=VERDICT_RANK.__getitem__, default="none")


# the GPU this tool builds for unless told otherwise (the table's default: a DGX Spark's
# GB10, sm_121)
DEFAULT_TARGET, DEFAULT_GPU_DRIVER = next(
    (Target(int(arch.replace(".", ""))), facts.driver) for arch, facts in GPU_TABLE.items()
    if facts.default and facts.driver is not None)


DEFAULT_GPU = str(DEFAULT_TARGET)  # `sm_121`: how runs, records and messages write it
DEFAULT_ARCH = DEFAULT_TARGET.dotted  # `12.1`: as an arch list writes it
DEFAULT_DRIVER_CUDA = ".".join(map(str, DEFAULT_GPU_DRIVER))  # `13.0`: the CUDA it runs


def is_default_gpu(name: str) -> bool:
    """Whether a GPU named as the tool writes it (`sm_121`: a record's, a manifest's) is the
    table's default."""
    return name == str(DEFAULT_TARGET)
