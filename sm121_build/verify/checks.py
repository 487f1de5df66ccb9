"""Verify a built image before it is tagged: cubins, kernel counts, version, drift, ABI.

Each check is a function of plain inputs that returns the problems it found (empty when
the check passes), so each can be tested on crafted files.  `verify_image` never exports an
image: drift is proven from the layer lists (diff IDs are content hashes, so a built image
whose list starts with the stock image's list carries the stock bytes unchanged) and from
the history of the added layers (each a copy of one injected file, of exactly its size).
The injected files, the stock image's copies of them, `_version.py` and the torch libraries
the ABI check needs are the only files read, each through the engine's per-path reads; what
the torch libraries export is cached per stock image ID.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml

from sm121_build.core.console import Progress, cut, note
from sm121_build.core.errors import CorruptBinaryError, Sm121Error, VerificationError
from sm121_build.core.inputs import read_input
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.labels import foreign
from sm121_build.core.paths import cache_dir, state_dir, store_bytes, store_cache
from sm121_build.cuda.binary import DEFAULT_POLICY, BinaryReport, Policy, audit_binary
from sm121_build.cuda.compat import DEFAULT_GPU, DEFAULT_TARGET, Target, cubin_loads, is_default_gpu
from sm121_build.cuda.dynsym import demangle, dynamic_symbols
from sm121_build.cuda.fatbin import Entry, HostBinary
from sm121_build.cuda.host import host_side
from sm121_build.image.api import RUNTIME_FIELDS, HistoryStep, ImageEngine, ImageFiles, ImageInfo
from sm121_build.image.facts import ImageFacts, VllmInstall, facts_from_files, require_vllm
from sm121_build.image.spill import write_stream


@cache
def left_out_rules() -> dict[str, tuple[re.Pattern[str], str]]:
    """Kernels a 12.x build leaves out on purpose: rule name -> (pattern, why), as
    data/left_out.yaml gives them."""
    raw = yaml.safe_load(resources.files("sm121_build").joinpath("data/left_out.yaml")
                         .read_text())
    return {str(r["name"]): (re.compile(str(r["pattern"])), " ".join(str(r["why"]).split()))
            for r in raw}


def left_out_reason(kernel: str) -> str | None:
    """Why a build for 12.x leaves this kernel out on purpose, or None."""
    return next((why for pattern, why in left_out_rules().values() if pattern.search(kernel)),
                None)


# nvcc names internal-linkage symbols `_INTERNAL_<hash>_<len>_<file>_<hash>` (CUDA 12): the
# first hash changes from build to build, so it is blanked (same length).  CUDA 13 names
# anonymous namespaces `_GLOBAL__N__<hash>_<len>_<file>_<hash>[_<n>]`, where both hashes
# (the second one hashes the source's path) and the counter vary: the namespace is compared
# as `_GLOBAL__N__<file>`, its length prefix recomputed.
_INTERNAL_HASH = re.compile(r"_INTERNAL_[0-9a-f]{8}_")
_ANONYMOUS = re.compile(r"(?<![0-9])([0-9]+)(?=_GLOBAL__N__)")
_ANONYMOUS_HEAD = re.compile(r"_GLOBAL__N__[0-9a-f]{8}_([0-9]+)_")
# CUB's namespace names the arch list it was compiled for (`CUB_300001_SM_800_900_1200`),
# which a rebuild for other archs changes: the namespace is compared as `CUB_SM`.
_CUB = re.compile(r"(?<![0-9])([0-9]+)(?=CUB_[0-9]+_SM_[0-9])")
_CUB_NAME = re.compile(r"CUB_[0-9]+_SM_[0-9]+(?:_[0-9]+)*")


def _anonymous(token: str) -> str | None:
    head = _ANONYMOUS_HEAD.match(token)
    if head is None:
        return None
    file = token[head.end():head.end() + int(head.group(1))]
    return f"_GLOBAL__N__{file}" if len(file) == int(head.group(1)) else None


def _cub(token: str) -> str | None:
    return "CUB_SM" if _CUB_NAME.fullmatch(token) else None


def _canonical_tokens(name: str, prefix: re.Pattern[str],
                      canonical: Callable[[str], str | None]) -> str:
    """Replace each length-prefixed source name that `prefix` finds by its canonical form."""
    out, at = [], 0
    for match in prefix.finditer(name):
        length, start = int(match.group(1)), match.end()
        if match.start() < at or start + length > len(name):
            continue
        new = canonical(name[start:start + length])
        if new is None:
            continue
        out += [name[at:match.start()], f"{len(new)}{new}"]
        at = start + length
    return "".join(out) + name[at:]


def kernel_key(name: str) -> str:
    """A kernel's name with what nvcc and CUB vary per build made canonical: the
    internal-linkage hash, the anonymous namespace, and the arch list in CUB's namespace."""
    name = _INTERNAL_HASH.sub("_INTERNAL_00000000_", name)
    name = _canonical_tokens(name, _ANONYMOUS, _anonymous)
    return _canonical_tokens(name, _CUB, _cub)


# Itanium-mangled names in the namespaces torch's libraries define (c10, at, torch, caffe2),
# including their vtables / typeinfo: `_ZN3c10...`, `_ZNK2at...`, `_ZTVN5torch...`.
# Extensions on PyTorch's stable ABI (vLLM's `*_stable_libtorch`, 0.2x) need no C++ symbol
# at all: they call torch's C shim (`aoti_torch_*`, `torch_*`), checked the same way.
TORCH_SYMBOL = re.compile(r"^(?:_Z(?:T[VIST])?N[rVKRO]*(?:3c10|2at|5torch|6caffe2)"
                          r"|aoti_torch_\w|torch_\w)")
TORCH_LIB = re.compile(r"/torch/lib/lib[^/]+\.so(\.\d+)*$")


# A kernel written for another GPU's instructions (CUTLASS's sm_90a GEMMs, Machete) is
# compiled for every other arch of its file as a body that only reports the wrong arch: a few
# instructions.  Such a stub loads on sm_121 but does nothing there; a build that leaves the
# kernel out loses nothing.  Evidence, from the stock file alone: the code sm_121 loads is at
# most STUB_BYTES while another cubin of the same file has at least STUB_RATIO times as much.
STUB_BYTES = 512
STUB_RATIO = 8


@dataclass(frozen=True)
class Stub:
    """A kernel whose sm_121-loadable code in the stock file is a stub."""

    sm: str  # the arch sm_121 loads it from
    size: int
    implemented: str  # the arch with its real code
    implemented_size: int

    def describe(self) -> str:
        return (f"{self.size} bytes on {self.sm}, {self.implemented_size} on "
                f"{self.implemented}")


Cubins = list[tuple[Entry, dict[str, int]]]  # each cubin entry, its kernels and their bytes


def cubins_of(path: Path) -> Cubins:
    """Every cubin of a .so with its kernels' code sizes: read once for both the name
    comparison and the stub evidence."""
    with HostBinary.open(path) as binary:
        return [(e, binary.kernel_sizes(e)) for e in binary.entries if e.kind == "elf"]


def stubs_of(cubins: Cubins, target: Target) -> dict[str, Stub]:
    """The kernels (by `kernel_key`) whose code `target` loads from these cubins (a file's,
    `cubins_of`) is a stub."""
    loaded: dict[str, tuple[int, str]] = {}
    elsewhere: dict[str, tuple[int, str]] = {}
    for entry, sizes in cubins:
        side = loaded if cubin_loads(entry.arch, entry.variant, target) else elsewhere
        for name, size in sizes.items():
            key = kernel_key(name)
            side[key] = max(side.get(key, (0, "")), (size, entry.sm))
    return {key: Stub(sm, size, elsewhere[key][1], elsewhere[key][0])
            for key, (size, sm) in loaded.items()
            if size <= STUB_BYTES and key in elsewhere
            and elsewhere[key][0] >= STUB_RATIO * max(size, 1)}


@dataclass(frozen=True)
class KernelComparison:
    """Kernels native on sm_121 in a built .so against the stock .so's newest arch."""

    name: str
    stock_arch: str | None
    stock_kernels: frozenset[str]
    built_native: frozenset[str]
    stubs: frozenset[str] = frozenset()  # stock kernels whose sm_121 code is a stub
    target: str = DEFAULT_GPU  # the GPU the build must serve

    @property
    def lost(self) -> frozenset[str]:
        return self.stock_kernels - self.built_native

    @property
    def fp4_excluded(self) -> tuple[str, ...]:
        """Lost kernels left out on purpose (data/left_out.yaml: FP4, Machete); the record
        keeps the field's first name."""
        return tuple(sorted(k for k in self.lost if left_out_reason(k)))

    @property
    def stubs_left_out(self) -> tuple[str, ...]:
        """Lost kernels that were stubs on sm_121 in the stock file (nothing is lost)."""
        return tuple(sorted((self.lost & self.stubs) - set(self.fp4_excluded)))

    @property
    def required(self) -> int:
        return len(self.stock_kernels) - len(self.fp4_excluded) - len(self.stubs_left_out)

    @property
    def missing(self) -> tuple[str, ...]:
        """Stock kernels (by name, nvcc's internal hash blanked) the build does not carry
        natively, FP4 kernels left out on purpose and stubs aside."""
        return tuple(sorted(self.lost - set(self.fp4_excluded) - self.stubs))

    def problems(self) -> list[str]:
        """One line per lost kernel: the same number of kernels is not enough, each stock
        kernel must be there by name."""
        if not is_default_gpu(self.target):  # aot for another GPU: all it loads, native
            return [f"{self.name}: kernel {kernel} is {self.stock_arch} in the stock image "
                    f"(natively or through the JIT) but not native there in the build"
                    for kernel in self.missing]
        return [f"{self.name}: kernel {kernel} has native {self.stock_arch} code in the stock "
                f"image but none for {DEFAULT_GPU} in the build" for kernel in self.missing]


def newest_of(cubins: Cubins) -> tuple[str | None, frozenset[str]]:
    """The newest SM a file's cubins (`cubins_of`) are for, and the kernels they
    define."""
    if not cubins:
        return None, frozenset()
    newest = max(entry.arch for entry, _ in cubins)
    return f"sm_{newest}", frozenset(kernel_key(k) for entry, sizes in cubins
                                     if entry.arch == newest for k in sizes)


def compare_kernels(name: str, stock: Path | None, built: BinaryReport,
                    target: Target = DEFAULT_TARGET,
                    stock_report: BinaryReport | None = None) -> KernelComparison:
    """The kernels the build must carry natively, by name: for the Spark, those of the stock
    file's newest arch (a build for sm_121 carries what the stock file's newest build did);
    for another GPU (aot alone), every kernel the stock file gives that GPU at all, natively
    or through the JIT (`stock_report`, audited for it): aot makes them all native."""
    cubins = cubins_of(stock) if stock else []
    arch, kernels = newest_of(cubins)
    if not target.is_default and stock_report is not None and stock_report.kernels is not None:
        arch = f"loadable on {target}"
        kernels = frozenset(kernel_key(k) for k, v in stock_report.kernels.items()
                            if v in ("native", "jit"))
    native = frozenset(kernel_key(k) for k, v in (built.kernels or {}).items() if v == "native")
    return KernelComparison(name, arch, kernels, native, frozenset(stubs_of(cubins, target)),
                            str(target))


def check_still_loadable(stock: BinaryReport | None, built: BinaryReport,
                         stubs: frozenset[str] = frozenset()) -> list[str]:
    """Every kernel the stock file gives sm_121 at all (native, or PTX the driver JITs) must
    load in the build too: a rebuild for 12.x-only archs can drop a family's PTX (its guard
    lists no 12.x entry), which would turn a slow kernel into a missing one.  FP4 kernels
    left out on purpose and stubs (`stubs`, by kernel key) aside."""
    if stock is None or stock.kernels is None or built.kernels is None:
        return []
    built_keys = {kernel_key(k): v for k, v in built.kernels.items()}
    lost = sorted(k for k, v in stock.kernels.items() if v in ("native", "jit")
                  and built_keys.get(kernel_key(k), "none") == "none"
                  and not left_out_reason(k) and kernel_key(k) not in stubs)
    return [f"{built.name}: kernel {kernel} loads on {DEFAULT_GPU} from the stock file "
            f"({stock.kernels[kernel]}) but not from the build" for kernel in lost]


def check_cubins(report: BinaryReport) -> list[str]:
    counts = report.kernel_counts()
    if counts["native"] == 0:
        return [f"{report.name} carries no {DEFAULT_GPU}-loadable cubin "
                f"(cubins: {report.arch_counts('elf') or 'none'})"]
    return []


def check_version(stock: VllmInstall, built: VllmInstall) -> list[str]:
    if (built.version, built.commit_id) != (stock.version, stock.commit_id):
        return [f"vLLM in the built image is {built.version} ({built.commit_id}), the stock "
                f"image has {stock.version} ({stock.commit_id})"]
    return []


def copy_destination(created_by: str) -> str | None:
    """Where a history step's COPY wrote, for BuildKit (`COPY SRC DEST # buildkit`) and the
    legacy builder (`/bin/sh -c #(nop) COPY file:<hash> in DEST `); None for other steps."""
    text = created_by.strip()
    text = text.removesuffix("# buildkit").strip()
    if "#(nop)" in text:
        text = text.split("#(nop)", 1)[1].strip()
    words = text.split()
    if len(words) < 3 or words[0] not in ("COPY", "ADD"):
        return None
    return words[-1]


def _metadata_only(step: HistoryStep) -> bool:
    text = step.created_by.split("#(nop)", 1)[-1].strip()
    word = text.split(maxsplit=1)[0] if text else ""
    return step.size == 0 and word in ("LABEL", "ENV", "CMD", "ENTRYPOINT", "WORKDIR", "USER",
                                       "EXPOSE", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "VOLUME",
                                       "ARG", "ONBUILD", "MAINTAINER")


def check_drift(stock: ImageInfo, built: ImageInfo, added: list[HistoryStep],
                injected: dict[str, int]) -> list[str]:
    """The built image must be the stock image's layers plus one copy of each injected file.

    Layers are content-addressed (a diff ID is the sha256 of the layer tar), so a built
    image whose layer list starts with the stock list holds the stock bytes unchanged.  Each
    added layer must then be accounted for by an added history step that copies one injected
    file (`injected`: path without the leading slash -> size) and adds exactly its size;
    other added steps may only set metadata.
    """
    problems = []
    kept = built.layers[:len(stock.layers)]
    if kept != stock.layers:
        first = next((i for i, (a, b) in enumerate(zip(kept, stock.layers, strict=False))
                      if a != b), len(kept))
        problems.append(f"the built image does not keep the stock image's {len(stock.layers)} "
                        f"layers (first difference at layer {first})")
    copied: list[str] = []
    for step in reversed(added):  # oldest first
        destination = copy_destination(step.created_by)
        path = destination.lstrip("/") if destination else None
        if path in injected and step.size == injected[path] and path not in copied:
            copied.append(path)
        elif not _metadata_only(step):
            problems.append(f"drift: added step {step.created_by.strip()[:120]!r} "
                            f"({step.size} bytes) is not a copy of one injected file")
    for path in sorted(set(injected) - set(copied)):
        problems.append(f"drift: no added layer holds /{path} as built")
    layers_added = len(built.layers) - len(stock.layers)
    if kept == stock.layers and layers_added != len(copied):
        problems.append(f"drift: {layers_added} layer(s) added on top of the stock image, "
                        f"{len(copied)} accounted for by copies of the injected files")
    return problems + check_config(stock, built)


# What Docker's builders write into a config that has no PATH (and what the engine gives a
# container of such an image anyway): not a change a container can see
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _default_path_only(stock: tuple[str, ...] | list[str],
                       built: tuple[str, ...] | list[str]) -> bool:
    """Whether the only difference is the default PATH a builder adds to a base that has no
    PATH at all (`docker import` makes such images): a container of either sees that PATH."""
    no_path = not any(e.startswith("PATH=") for e in stock)
    return no_path and [e for e in built if e != DEFAULT_PATH] == list(stock)


def check_config(stock: ImageInfo, built: ImageInfo) -> list[str]:
    """The runtime config (env, entrypoint, cmd, workdir, user, exposed ports) and every
    label the tool does not set must reach the result unchanged: one line per difference."""
    problems = []
    if built.env != stock.env and not _default_path_only(stock.env, built.env):
        changed = [f"+{e}" for e in built.env if e not in stock.env] + \
            [f"-{e}" for e in stock.env if e not in built.env] or ["(order)"]
        problems.append(f"drift: env differs from the stock image ({', '.join(changed)[:120]})")
    names = [name for _key, name in RUNTIME_FIELDS]
    for name, was, now in zip(names, stock.runtime, built.runtime, strict=False):
        if was != now:
            problems.append(f"drift: {name} is {now} in the built image, {was} in the stock "
                            "image")
    if len(built.runtime) != len(stock.runtime):
        problems.append("drift: the runtime config has another shape than the stock image's")
    theirs, kept = foreign(stock.labels), foreign(built.labels)
    for key in sorted(set(theirs) | set(kept)):
        if theirs.get(key) != kept.get(key):
            problems.append(f"drift: label {key} is {kept.get(key)!r} in the built image, "
                            f"{theirs.get(key)!r} in the stock image")
    return problems


@dataclass(frozen=True)
class AbiResult:
    checked: int
    missing: dict[str, tuple[str, ...]]  # .so name -> torch symbols no provider exports
    providers: int  # torch libraries read
    torch: str | None  # their version, when known

    def problems(self) -> list[str]:
        missing = sorted(self.missing.items())
        if not self.providers:
            return [f"ABI: {name} needs {len(symbols)} torch symbol(s), but the image has no "
                    f"torch/lib/*.so to export them" for name, symbols in missing]
        torch = f"torch {self.torch}" if self.torch else "torch"
        return [f"ABI: {name} needs {len(symbols)} torch symbol(s) the image's {torch} does "
                f"not export, e.g. {_shown(symbols[0])}: built against another torch?"
                for name, symbols in missing]


def _shown(symbol: str) -> str:
    """A symbol from an injected file in a problem line: demangled where that is bounded,
    both forms cut (a symbol is outside text; a problem line is never its length)."""
    readable = demangle(symbol)
    mangled = cut(symbol, 240, tail=60)
    return mangled if readable == symbol else f"{cut(readable, 240, tail=60)} ({mangled})"


def torch_exports(providers: list[Path]) -> set[str]:
    """The c10/at/torch symbols torch's libraries export."""
    exported: set[str] = set()
    for library in providers:
        exported |= {s for s in dynamic_symbols(library).exported if TORCH_SYMBOL.match(s)}
    return exported


def check_abi(injected: dict[str, Path], exported: set[str], providers: int,
              torch: str | None = None) -> AbiResult:
    """Undefined c10/at/torch symbols of the injected files vs what torch's libraries export
    (`providers`: how many libraries were read for `exported`; `torch`: their version)."""
    missing: dict[str, tuple[str, ...]] = {}
    checked = 0
    for name, path in injected.items():
        needed = {s for s in dynamic_symbols(path).undefined if TORCH_SYMBOL.match(s)}
        checked += len(needed)
        absent = tuple(sorted(needed - exported))
        if absent:
            missing[name] = absent
    return AbiResult(checked, missing, providers, torch)


def image_torch_exports(files: ImageFiles, image_id: str, site: str,
                        tmp: Path) -> tuple[set[str], int]:
    """(exported torch symbols, libraries read) of an image's `torch/lib`, streamed one
    library at a time (temp: the largest one), cached per image ID."""
    cached = cache_dir() / "abi" / f"{image_id.replace(':', '-')}.v2.json"  # v2: GNU_UNIQUE
    with suppress(OSError, ValueError, TypeError, KeyError, RecursionError, Sm121Error):
        data = read_input(cached, 256 << 20, "cached ABI")
        # the cache may come from anywhere: used only when the state vouches for it
        recorded = read_input(_abi_voucher(cached), 128, "an ABI digest").decode().strip()
        if hashlib.sha256(data).hexdigest() == recorded:
            raw = json.loads(data)
            return set(raw["exported"]), int(raw["libraries"])
    exported: set[str] = set()
    libraries = 0
    lib_dir = f"{site}/torch/lib"
    if files.resolve(lib_dir) is not None:
        with files.tar(lib_dir) as archive:
            for member in archive:
                # the engine names members after the folder's own name (`lib/libc10.so`)
                path = posixpath.join(posixpath.dirname(lib_dir), member.name)
                if not member.isfile() or not TORCH_LIB.search(path):
                    continue
                handle = archive.extractfile(member)
                if handle is None:
                    continue
                part = tmp / "torch-lib.so"
                write_stream(handle, part, f"{lib_dir}/{member.name}")
                exported |= torch_exports([part])
                libraries += 1
                part.unlink()
    text = json.dumps({"exported": sorted(exported), "libraries": libraries})
    if store_bytes(_abi_voucher(cached), hashlib.sha256(text.encode()).hexdigest().encode()):
        store_cache(cached, text)
    return exported, libraries


def _abi_voucher(cached: Path) -> Path:
    """Where the state folder keeps the digest of an ABI entry this tool wrote (no cache
    restore brings the state along)."""
    return state_dir() / "abi-digests" / cached.name


# Where a placed file comes from: compiled from source in this run, placed as it came
# (injected artifacts, a kernels image), or the stock file with cubins added by aot
Origin = Literal["built", "placed", "aot"]


def check_host_code(name: str, stock: Path | None, built: Path, modes: tuple[int | None, int],
                    origin: Origin) -> list[str]:
    """The host side of a placed file against the stock file it replaces: the same ELF class
    and machine (an aarch64 file in an amd64 image cannot load), the module's `PyInit_*`
    export, no library needed that the stock file did not need; a file not compiled here
    also has the stock file's mode; an aot'd file, whose host code is the stock file's,
    exports nothing new and runs no more initialisers (DT_INIT, .init_array).  (A file built
    from source here or elsewhere registers its own kernels: its initialisers and exports
    may differ, and are not judged.)"""
    if stock is None:
        return []
    try:
        was, now = host_side(stock), host_side(built)
    except CorruptBinaryError as exc:
        return [f"{name}: {exc}"]
    problems = []
    if was.ident != now.ident:
        problems.append(f"{name}: ELF class/machine {now.ident} is not the stock file's "
                        f"{was.ident} (a file for another platform)")
    lost = sorted(s for s in was.symbols.exported - now.symbols.exported
                  if s.startswith("PyInit_"))
    if lost:
        problems.append(f"{name}: no longer exports {lost[0]}: Python cannot import it")
    needed = sorted(now.needed - was.needed)
    if needed:
        problems.append(f"{name}: needs {', '.join(needed)}, which the stock file did not")
    if origin != "built" and modes[0] is not None and \
            modes[0] & 0o7777 != modes[1] & 0o7777:
        problems.append(f"{name}: mode {modes[1] & 0o7777:o}, the stock file's "
                        f"{modes[0] & 0o7777:o}")
    if origin != "aot":
        return problems
    added = sorted(now.symbols.exported - was.symbols.exported)
    if added:
        problems.append(f"{name}: exports {len(added)} symbol(s) the stock file did not, e.g. "
                        f"{added[0][:80]} (an aot'd file carries the stock file's host code)")
    if now.initialisers > was.initialisers:
        problems.append(f"{name}: {now.initialisers} initialiser(s) run at load, the stock "
                        f"file {was.initialisers}")
    return problems


@dataclass
class Verified:
    """What verification found; `files` are the built .so files (valid inside the context)."""

    facts: ImageFacts
    files: dict[str, Path]
    reports: dict[str, BinaryReport]
    comparisons: dict[str, KernelComparison]
    abi: AbiResult
    stock_reports: dict[str, BinaryReport] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Candidate:
    """An image to verify against the base it was made from: the files it placed (by their
    paths under the vLLM package), the log to write problems to, and where each file comes
    from (`Origin`; "built" where not named), which says how much of its host code must be
    the stock file's (`check_host_code`)."""

    stock: ImageFacts
    image_id: str
    extensions: tuple[str, ...]
    log: Path | None = None
    origins: Mapping[str, Origin] = field(default_factory=dict)
    files_under: str | None = None  # the folder the files are named under (vLLM's package)
    stock_read: StockRead | None = None  # the stock side, when it was read ahead
    gpu: Policy = DEFAULT_POLICY  # the GPU whose native kernels are verified


@dataclass(frozen=True)
class StockRead:
    """The stock image's side of verification, read once: each placed file's stock copy
    (absent where the base has none), its mode and audit, and what torch exports."""

    copies: Mapping[str, Path]
    modes: Mapping[str, int]
    reports: Mapping[str, BinaryReport]
    exported: frozenset[str]
    providers: int


def read_stock_side(engine: ImageEngine, stock: ImageFacts,
                    placed: tuple[tuple[str, ...], str | None], dest: Path,
                    gpu: Policy = DEFAULT_POLICY) -> StockRead:
    """The stock copies of the files (their names, under a folder or else vLLM's package)
    into `dest`, audited for `gpu`, and torch's exports: what verification compares a
    candidate with.  It depends on the base alone, so the pipeline reads it while the
    candidate builds."""
    names, under = placed
    vllm = require_vllm(stock)
    package = under or vllm.package_dir
    copies: dict[str, Path] = {}
    modes: dict[str, int] = {}
    reports: dict[str, BinaryReport] = {}
    with engine.reader(stock.id) as files:
        for name in names:
            local = dest / name
            local.parent.mkdir(parents=True, exist_ok=True)
            found = files.copy_file(posixpath.join(package, name), local)
            if found is None:
                local.unlink(missing_ok=True)
                continue
            copies[name], modes[name] = local, found.mode
            reports[name] = audit_binary(local, name, gpu, with_kernels=True)
        exported, providers = image_torch_exports(files, stock.id, vllm.site_packages, dest)
    return StockRead(copies, modes, reports, frozenset(exported), providers)


@contextmanager
def verify_image(engine: ImageEngine, candidate: Candidate) -> Iterator[Verified]:
    """Run every check on a built image; raises VerificationError listing what failed."""
    stock, image_id, extensions = candidate.stock, candidate.image_id, candidate.extensions
    log, origins = candidate.log, candidate.origins
    stock_vllm = require_vllm(stock)
    package = candidate.files_under or stock_vllm.package_dir
    stock_info, built_info = engine.image(stock.id), engine.image(image_id)
    base_count = len(stock_info.layers)
    stock_steps = len(engine.history(stock.id))
    built_history = engine.history(image_id)
    added = built_history[:max(0, len(built_history) - stock_steps)]

    progress = Progress("reading the placed files")
    with temp_dir("sm121-verify-") as tmp, \
            engine.reader(image_id, progress.add) as built_files:
        root = Path(tmp)
        (root / "built").mkdir()
        read = candidate.stock_read or read_stock_side(
            engine, stock, (extensions, candidate.files_under), root / "stock", candidate.gpu)
        built = facts_from_files(built_info, built_files)
        problems = check_version(stock_vllm, require_vllm(built))
        files: dict[str, Path] = {}
        sizes: dict[str, int] = {}
        reports: dict[str, BinaryReport] = {}
        comparisons: dict[str, KernelComparison] = {}
        stock_reports = dict(read.reports)
        for name in extensions:
            path = posixpath.join(package, name)
            (root / "built" / name).parent.mkdir(parents=True, exist_ok=True)
            found = built_files.copy_file(path, root / "built" / name)
            if found is None:
                problems.append(f"the built image lacks {path}")
                continue
            files[name], sizes[path.lstrip("/")] = root / "built" / name, found.size
            report = audit_binary(files[name], name, candidate.gpu, with_kernels=True)
            reports[name] = report
            stock_copy = read.copies.get(name)
            problems += check_host_code(name, stock_copy, files[name],
                                        (read.modes.get(name), found.mode),
                                        origins.get(name, "built"))
            comparison = compare_kernels(name, stock_copy, report, candidate.gpu.target,
                                         stock_reports.get(name))
            comparisons[name] = comparison
            problems += check_cubins(report) + comparison.problems() + check_still_loadable(
                stock_reports.get(name), report, comparison.stubs)
            note(f"{name}: cubins {report.arch_counts('elf')}; {len(comparison.built_native)} "
                  f"kernels native on {candidate.gpu} (stock "
                  f"{comparison.stock_arch or 'no cubins'}: "
                  f"{len(comparison.stock_kernels)})")
            if comparison.stubs_left_out:
                example = comparison.stubs_left_out[0]
                note(f"{name}: {len(comparison.stubs_left_out)} kernel(s) left out that were "
                     f"stubs on {DEFAULT_GPU} in the stock file, e.g. {example[:80]}")
            reasons = Counter(left_out_reason(k) for k in comparison.fp4_excluded)
            for why, count in sorted(reasons.items(), key=lambda item: str(item[0])):
                example = next(k for k in comparison.fp4_excluded if left_out_reason(k) == why)
                note(f"{name}: {count} kernel(s) left out on purpose ({why}), e.g. "
                     f"{example[:80]}")
        exported, providers = set(read.exported), read.providers
        progress.done()
        abi = check_abi(files, exported, providers, stock_vllm.torch_version)
        note(f"ABI: {abi.checked} torch symbol(s) needed, checked against "
              f"{providers} torch librar{'y' if providers == 1 else 'ies'}"
              + (f" (torch {abi.torch})" if abi.torch else ""))
        drift = check_drift(stock_info, built_info, added, sizes)
        note(f"drift: {base_count} stock layers kept, {len(built_info.layers) - base_count} "
              f"layer(s) added on top, {len(drift)} problem(s)")
        problems += abi.problems() + drift
        if problems:
            if log:
                with open(log, "a", encoding="utf-8") as out:
                    out.write("verification failed:\n" + "".join(f"  {p}\n" for p in problems))
            more = f" (+{len(problems) - 1} more{f', see {log}' if log else ''})" \
                if len(problems) > 1 else ""
            raise VerificationError(f"verification failed: {problems[0]}{more}; not tagged")
        yield Verified(built, files, reports, comparisons, abi, stock_reports, problems)
