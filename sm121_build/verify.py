"""Verify a built image before it is tagged: cubins, kernel counts, version, drift, ABI.

Each check is a function of plain inputs that returns the problems it found (empty when
the check passes), so each can be tested on crafted files.  `verify_image` reads the built
image once (`docker save`, one pass over its layers) and runs them all; the stock image's
copies of the injected files are taken from the same pass, at the last stock layer.
"""

from __future__ import annotations

import posixpath
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from . import layers
from .audit import BinaryReport, Policy, audit_binary
from .compat import parse_target
from .errors import VerificationError
from .fatbin import HostBinary, dynamic_symbols
from .inspect import ImageFacts, VllmInstall, facts_from_filesystem, require_vllm
from .inspect import wanted as facts_wanted

if TYPE_CHECKING:  # the Docker SDK is not needed to run the checks themselves
    from .engine import Engine, ImageInfo

SM121 = Policy(parse_target("sm_121"), (13, 0))
# Kernels left out on purpose when the FP4 guards exclude a plain 12.x build.
FP4_KERNEL = re.compile(r"fp4|e2m1|qutlass", re.IGNORECASE)
# nvcc names internal-linkage symbols `_INTERNAL_<hash>_<len>_<file>_<hash>`; the first hash
# changes from build to build, so names are compared with it blanked (same length).
_INTERNAL_HASH = re.compile(r"_INTERNAL_[0-9a-f]{8}_")


def kernel_key(name: str) -> str:
    """A kernel's name with nvcc's per-build internal-linkage hash blanked."""
    return _INTERNAL_HASH.sub("_INTERNAL_00000000_", name)
# Itanium-mangled names in the namespaces torch's libraries define (c10, at, torch, caffe2),
# including their vtables / typeinfo: `_ZN3c10...`, `_ZNK2at...`, `_ZTVN5torch...`.
TORCH_SYMBOL = re.compile(r"^_Z(?:T[VIST])?N[rVKRO]*(?:3c10|2at|5torch|6caffe2)")
TORCH_LIB = re.compile(r"/torch/lib/lib[^/]+\.so(\.\d+)*$")


@dataclass(frozen=True)
class KernelComparison:
    """Kernels native on sm_121 in a built .so against the stock .so's newest arch."""

    name: str
    stock_arch: str | None
    stock_kernels: frozenset[str]
    built_native: frozenset[str]

    @property
    def lost(self) -> frozenset[str]:
        return self.stock_kernels - self.built_native

    @property
    def fp4_excluded(self) -> tuple[str, ...]:
        return tuple(sorted(k for k in self.lost if FP4_KERNEL.search(k)))

    @property
    def required(self) -> int:
        return len(self.stock_kernels) - len(self.fp4_excluded)

    def problems(self) -> list[str]:
        if len(self.built_native) >= self.required:
            return []
        others = sorted(self.lost - set(self.fp4_excluded))
        return [f"{self.name}: {len(self.built_native)} kernels native on sm_121, fewer than the "
                f"{self.required} the stock {self.stock_arch} cubins had (FP4 excluded); "
                f"missing e.g. {', '.join(others[:3])}"]


def newest_arch_kernels(path: Path) -> tuple[str | None, frozenset[str]]:
    """The newest SM a .so has cubins for, and the kernels those cubins define."""
    with HostBinary.open(path) as binary:
        cubins = [e for e in binary.entries if e.kind == "elf"]
        if not cubins:
            return None, frozenset()
        newest = max(e.arch for e in cubins)
        names: set[str] = set()
        for entry in cubins:
            if entry.arch == newest:
                names.update(kernel_key(k) for k in binary.kernels(entry))
    return f"sm_{newest}", frozenset(names)


def compare_kernels(name: str, stock: Path | None, built: BinaryReport) -> KernelComparison:
    arch, kernels = newest_arch_kernels(stock) if stock else (None, frozenset[str]())
    native = frozenset(kernel_key(k) for k, v in (built.kernels or {}).items() if v == "native")
    return KernelComparison(name, arch, kernels, native)


def check_cubins(report: BinaryReport) -> list[str]:
    counts = report.kernel_counts()
    if counts["native"] == 0:
        return [f"{report.name} carries no sm_121-loadable cubin "
                f"(cubins: {report.arch_counts('elf') or 'none'})"]
    return []


def check_version(stock: VllmInstall, built: VllmInstall) -> list[str]:
    if (built.version, built.commit_id) != (stock.version, stock.commit_id):
        return [f"vLLM in the built image is {built.version} ({built.commit_id}), the stock "
                f"image has {stock.version} ({stock.commit_id})"]
    return []


def check_drift(stock: ImageInfo, built: ImageInfo, added: list[layers.LayerChange],
                injected: set[str]) -> list[str]:
    """Every file other than the injected ones must be the stock image's own bytes.

    Layers are content-addressed (diff IDs are sha256 of the layer tar), so the stock layers
    kept as the built image's bottom layers are byte-identical; what remains is to list what
    the layers on top change.
    """
    problems = []
    kept = built.layers[:len(stock.layers)]
    if kept != stock.layers:
        first = next((i for i, (a, b) in enumerate(zip(kept, stock.layers, strict=False))
                      if a != b), len(kept))
        problems.append(f"the built image does not keep the stock image's {len(stock.layers)} "
                        f"layers (first difference at layer {first})")
    for change in added:
        if change.kind == "file" and change.path in injected:
            continue
        problems.append(f"drift: /{change.path} ({change.kind}) differs from the stock image")
    if (built.env, built.runtime) != (stock.env, stock.runtime):
        problems.append("drift: the image config (env, entrypoint, cmd, workdir, user, ports) "
                        "differs from the stock image")
    return problems


@dataclass(frozen=True)
class AbiResult:
    checked: int
    missing: dict[str, tuple[str, ...]]  # .so name -> torch symbols no provider exports

    def problems(self) -> list[str]:
        return [f"ABI: {name} needs {len(symbols)} torch symbol(s) the image's torch does not "
                f"export, e.g. {symbols[0]}" for name, symbols in sorted(self.missing.items())]


def check_abi(injected: dict[str, Path], providers: list[Path]) -> AbiResult:
    """Undefined c10/at/torch symbols of the injected files vs what torch's libraries export."""
    exported: set[str] = set()
    for library in providers:
        exported |= dynamic_symbols(library).exported
    missing: dict[str, tuple[str, ...]] = {}
    checked = 0
    for name, path in injected.items():
        needed = {s for s in dynamic_symbols(path).undefined if TORCH_SYMBOL.match(s)}
        checked += len(needed)
        absent = tuple(sorted(needed - exported))
        if absent:
            missing[name] = absent
    if checked and not providers:
        missing = {name: ("(no torch/lib/*.so found in the image)",) for name in injected}
    return AbiResult(checked, missing)


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


def _echo(text: str) -> None:
    click.echo(f"    {text}", err=True)


@contextmanager
def verify_image(engine: Engine, stock: ImageFacts, image_id: str,
                 extensions: tuple[str, ...], log: Path | None = None) -> Iterator[Verified]:
    """Run every check on a built image; raises VerificationError listing what failed."""
    stock_vllm = require_vllm(stock)
    package = stock_vllm.package_dir.lstrip("/")
    site = stock_vllm.site_packages.lstrip("/")
    injected = {f"{package}/{name}" for name in extensions}
    stock_info, built_info = engine.image(stock.id), engine.image(image_id)
    base_count = len(stock_info.layers)

    def wanted(path: str) -> bool:
        return (path in injected or facts_wanted(path)
                or (path.startswith(site + "/") and bool(TORCH_LIB.search(path))))

    with tempfile.TemporaryDirectory(prefix="sm121-verify-") as tmp:
        root = Path(tmp)
        stock_copies = root / "stock"
        stock_copies.mkdir()
        added: list[layers.LayerChange] = []

        def on_layer(index: int, changes: list[layers.LayerChange],
                     fs: layers.Filesystem) -> None:
            if index == base_count - 1:
                for path in injected & fs.extracted:
                    shutil.copyfile(fs.root / path, stock_copies / posixpath.basename(path))
            elif index >= base_count:
                added.extend(changes)

        archive = root / "image.tar"
        engine.save(image_id, archive)
        fs = layers.extract_files(archive, root / "rootfs", wanted, built_info.platform,
                                  on_layer=on_layer)
        archive.unlink()
        built = facts_from_filesystem(built_info, fs)
        problems = check_version(stock_vllm, require_vllm(built))
        files: dict[str, Path] = {}
        reports: dict[str, BinaryReport] = {}
        comparisons: dict[str, KernelComparison] = {}
        stock_reports: dict[str, BinaryReport] = {}
        for name in extensions:
            path = f"{package}/{name}"
            if path not in fs.extracted:
                problems.append(f"the built image lacks /{path}")
                continue
            files[name] = fs.root / path
            report = audit_binary(files[name], name, SM121, with_kernels=True)
            reports[name] = report
            stock_copy = stock_copies / name
            if stock_copy.exists():
                stock_reports[name] = audit_binary(stock_copy, name, SM121, with_kernels=True)
            comparison = compare_kernels(name, stock_copy if stock_copy.exists() else None, report)
            comparisons[name] = comparison
            problems += check_cubins(report) + comparison.problems()
            _echo(f"{name}: cubins {report.arch_counts('elf')}; {len(comparison.built_native)} "
                  f"kernels native on sm_121 (stock {comparison.stock_arch or 'no cubins'}: "
                  f"{len(comparison.stock_kernels)})")
            if comparison.fp4_excluded:
                _echo(f"{name}: {len(comparison.fp4_excluded)} FP4 kernel(s) excluded on purpose,"
                      f" e.g. {comparison.fp4_excluded[0]}")
        providers = sorted(fs.root / p for p in fs.extracted if TORCH_LIB.search("/" + p))
        abi = check_abi(files, providers)
        _echo(f"ABI: {abi.checked} torch symbol(s) needed, checked against "
              f"{len(providers)} torch librar{'y' if len(providers) == 1 else 'ies'}")
        drift = check_drift(stock_info, built_info, added, injected)
        _echo(f"drift: {base_count} stock layers kept, {len(added)} file(s) added on top, "
              f"{len(drift)} problem(s)")
        problems += abi.problems() + drift
        if problems:
            if log:
                with open(log, "a", encoding="utf-8") as out:
                    out.write("verification failed:\n" + "".join(f"  {p}\n" for p in problems))
            more = f" (+{len(problems) - 1} more{f', see {log}' if log else ''})" \
                if len(problems) > 1 else ""
            raise VerificationError(f"verification failed: {problems[0]}{more}; not tagged")
        yield Verified(built, files, reports, comparisons, abi, stock_reports, problems)
