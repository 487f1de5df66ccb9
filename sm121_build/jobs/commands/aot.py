"""`sm121-build aot`: native SASS from the PTX a binary already ships, with no source.

For every fatbin container of a file whose code does not load natively on the GPU but has
PTX it can JIT, ptxas compiles that PTX for the GPU ahead of time (what the driver's JIT does
at first start: the same PTX, the default optimisation, the options the entry records) and
the cubin is added to that container (`cuda/fatbin_rewrite`).  Modules compile on every
core, largest first (the largest sets the wall time).  Each rewritten file is verified
against its stock file (`verify/aot_check`) and one module per file is compiled again and
its code compared, before anything is written; a file that cannot be rewritten is one line,
and is left as it was.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import click

from sm121_build.core.console import LiveLine, end_status_line, note, notice, result
from sm121_build.core.errors import CorruptBinaryError, Sm121Error, ToolchainError
from sm121_build.core.outputs import refuse_links_below, replace_bytes, replace_file
from sm121_build.core.paths import store_bytes
from sm121_build.core.units import duration, human_size
from sm121_build.cuda.binary import jit_ptx
from sm121_build.cuda.compat import Target
from sm121_build.cuda.elf import Elf
from sm121_build.cuda.fatbin import entry_payload, read_entry
from sm121_build.cuda.fatbin_rewrite import (
    Layout,
    NoFatbin,
    entry_options,
    read_layout,
    rewrite,
)
from sm121_build.cuda.ptxas import (
    Toolchain,
    arch_for,
    checked_options,
    compile_ptx,
    fatbin_entry,
)
from sm121_build.verify.aot_check import check_aot

ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class AotRequest:
    """What one `aot` run takes: the inputs, where results go, the GPU, the tools."""

    inputs: tuple[Path, ...]
    out: Path
    target: Target
    toolchain: Toolchain
    jobs: int
    timeout: float
    cache: Path | None  # compiled entries by content (None: --no-cache)


@dataclass(frozen=True)
class Module:
    """One PTX entry to compile: which file and container it belongs to."""

    file: int
    container: int
    ptx: bytes
    options: tuple[str, ...]
    arch: str


@dataclass
class FileWork:
    """A file with code to add: its stock bytes, layout, and the cubins made for it."""

    name: str  # as the user sees it: a path, or WHEEL!member
    data: bytes
    layout: Layout
    mode: int
    cubins: dict[int, bytes] = field(default_factory=dict)
    entries: dict[int, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class FileResult:
    name: str
    modules: int
    stock_size: int
    new_size: int
    sass_bytes: int  # the new cubins, uncompressed
    entry_bytes: int  # the new entries as stored (compressed)


@dataclass
class AotResult:
    files: list[FileResult] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    written: list[Path] = field(default_factory=list)


def run_aot(request: AotRequest) -> AotResult:
    started = time.monotonic()
    outcome = AotResult()
    wheels = [s for s in request.inputs if s.suffix == ".whl" and zipfile.is_zipfile(s)]
    _aot_files([s for s in request.inputs if s not in wheels], request, outcome)
    for wheel in wheels:
        _aot_wheel(wheel, request, outcome)
    outcome.wall_seconds = time.monotonic() - started
    return outcome


def _aot_files(sources: list[Path], request: AotRequest, outcome: AotResult) -> None:
    """.so files and folders of them, compiled as one batch: each rewritten file at its
    path relative to what was given, under --out."""
    works: list[FileWork] = []
    names: dict[str, Path] = {}
    for path, relative in (found for source in sources for found in _elf_files(source)):
        data = path.read_bytes()
        work = _plan(str(path), data, path.stat().st_mode, request.target, outcome)
        if work is not None:
            works.append(work)
            names[work.name] = relative
    for work, new in _compile_and_rewrite(works, request, outcome):
        target = request.out / names[work.name]
        _write_new(request.out, target, new, stat.S_IMODE(work.mode))
        outcome.written.append(target)


def _elf_files(source: Path) -> Iterator[tuple[Path, Path]]:
    """(path, path relative to what was given) of the ELF files; links are not followed."""
    if source.is_file():
        yield source, Path(source.name)
        return
    for root, dirs, files in os.walk(source, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if path.is_symlink() or not path.is_file():
                continue
            with open(path, "rb") as handle:
                if handle.read(4) == ELF_MAGIC:
                    yield path, path.relative_to(source)


def _plan(name: str, data: bytes, mode: int, target: Target,
          outcome: AotResult) -> FileWork | None:
    """The file's layout when it has JIT-only containers to compile; None when it has none
    (host code only, or everything loads natively already)."""
    if b".nv_fatbin" not in data:  # the section's name: host code only
        return None
    try:
        layout = read_layout(data, name)
    except NoFatbin:
        return None
    except CorruptBinaryError as exc:
        outcome.failed.append(str(exc))
        return None
    work = FileWork(name, data, layout, mode)
    return work if any(jit_ptx(c.described, target) for c in layout.containers) \
        else None


def _modules(works: list[FileWork], request: AotRequest,
             outcome: AotResult) -> list[Module]:
    modules = []
    for number, work in enumerate(works):
        for index, container in enumerate(work.layout.containers):
            entry = jit_ptx(container.described, request.target)
            if entry is None:
                continue
            raw = container.entries[container.described.index(entry)]
            if entry.version > request.toolchain.newest_isa:
                outcome.failed.append(
                    f"{work.name}: container {index}'s PTX is ISA {entry.version[0]}."
                    f"{entry.version[1]}, newer than {request.toolchain} reads; left JIT-only")
                continue
            try:
                options = tuple(checked_options(entry_options(raw)))
            except ToolchainError as exc:
                outcome.failed.append(f"{work.name}: container {index}: {exc}")
                continue
            ptx = entry_payload(work.data, entry, work.name)
            modules.append(Module(number, index, ptx, options,
                                  arch_for(request.target, entry.variant)))
    return sorted(modules, key=lambda m: -len(m.ptx))


def _compile_and_rewrite(works: list[FileWork], request: AotRequest,
                         outcome: AotResult) -> Iterator[tuple[FileWork, bytes]]:
    modules = _modules(works, request, outcome)
    if not modules:
        return
    total = sum(len(m.ptx) for m in modules)
    note(f"aot: {len(modules)} PTX module(s) in {len({m.file for m in modules})} file(s), "
         f"{human_size(total)} of PTX, for {request.target} with {request.toolchain}, "
         f"{request.jobs} at a time, largest first")
    failed_files: set[int] = set()
    line = LiveLine(every=30.0, gap=0.2)
    started, done_bytes, done, before = time.monotonic(), 0, 0, os.times()
    busy = 0.0  # seconds the finished modules took, each on its own core
    with ThreadPoolExecutor(request.jobs) as pool:
        futures = {pool.submit(_compile_one, m, request): m for m in modules}
        for future in as_completed(futures):
            module = futures[future]
            work = works[module.file]
            try:
                cubin, entry, seconds = future.result()
            except ToolchainError as exc:
                outcome.failed.append(f"{work.name}: container {module.container}: {exc}")
                failed_files.add(module.file)
                continue
            work.cubins[module.container], work.entries[module.container] = cubin, entry
            done, done_bytes = done + 1, done_bytes + len(module.ptx)
            elapsed, busy = time.monotonic() - started, busy + seconds
            # seconds per byte of PTX on one core, so far, over the cores at work
            left = busy / done_bytes * (total - done_bytes) / request.jobs
            line(f"aot [{done}/{len(modules)}] {100 * done_bytes // total}% of the PTX, "
                 f"{duration(elapsed)}; about {duration(left)} left")
    end_status_line()
    after = os.times()  # the ptxas and fatbinary processes, all of them waited for
    outcome.cpu_seconds += (after.children_user - before.children_user
                            + after.children_system - before.children_system)
    for number, work in enumerate(works):
        if number in failed_files or not work.entries:
            continue
        try:
            new = _rewrite_checked(number, work, request, modules)
        except CorruptBinaryError as exc:
            outcome.failed.append(f"{work.name}: {exc}; left as it was")
            continue
        if new is None:
            outcome.failed.append(f"{work.name}: verification failed; left as it was")
            continue
        sass = sum(len(c) for c in work.cubins.values())
        stored = sum(len(e) for e in work.entries.values())
        outcome.files.append(FileResult(work.name, len(work.entries), len(work.data),
                                        len(new), sass, stored))
        yield work, new


def _compile_one(module: Module, request: AotRequest) -> tuple[bytes, bytes, float]:
    started = time.monotonic()
    return (*_compiled(module, request), time.monotonic() - started)


def _compiled(module: Module, request: AotRequest) -> tuple[bytes, bytes]:
    """The module's cubin and fatbin entry: from the cache when this ptxas already compiled
    this PTX with these options for this GPU (ptxas is deterministic but for its notes, and
    each file's verification compiles one module again), else compiled now and kept."""
    key = hashlib.sha256(b"\0".join([module.ptx, module.arch.encode(),
                                      " ".join(module.options).encode(),
                                      request.toolchain.version.encode()])).hexdigest()
    cached = _cached_entry(request.cache / key[:2] / key, module) if request.cache else None
    if cached is not None:
        return cached
    cubin = compile_ptx(request.toolchain, module.ptx, module.arch, list(module.options),
                        request.timeout)
    entry = fatbin_entry(request.toolchain, cubin, module.arch.removeprefix("sm_"),
                         request.timeout)
    if request.cache:
        store_bytes(request.cache / key[:2] / key, entry)
    return cubin, entry


def _cached_entry(path: Path, module: Module) -> tuple[bytes, bytes] | None:
    """A cached entry that reads as a cubin for the module's GPU, with that cubin."""
    try:
        entry = path.read_bytes()
        described, _end = read_entry(path, entry, 0, len(entry))
        if described is None or described.kind != "elf" or \
                f"sm_{described.arch}" != module.arch.rstrip("a"):
            return None
        cubin = entry_payload(entry, described, str(path))
        return (cubin, entry) if cubin[:4] == ELF_MAGIC else None
    except (OSError, CorruptBinaryError):
        return None


def _rewrite_checked(number: int, work: FileWork, request: AotRequest,
                     modules: list[Module]) -> bytes | None:
    """The rewritten file, or None (said) when verification finds a problem."""
    replaced = {index: (*work.layout.containers[index].entries, entry)
                for index, entry in work.entries.items()}
    new = rewrite(work.data, work.layout, replaced)
    problems = check_aot(work.data, new, request.target, work.name)
    # one module per file compiled again: the added code must be what ptxas gives
    mine = [m for m in modules if m.file == number and m.container in work.cubins]
    if mine and not problems:
        smallest = min(mine, key=lambda m: len(m.ptx))
        again = compile_ptx(request.toolchain, smallest.ptx, smallest.arch,
                            list(smallest.options), request.timeout)
        if _code(again) != _code(_stored_cubin(new, work, smallest.container)):
            problems.append(f"{work.name}: container {smallest.container}'s added code "
                            "differs from a fresh ptxas run")
    for problem in problems:
        notice(f"verification: {problem}")
    return None if problems else new


def _stored_cubin(new: bytes, work: FileWork, container: int) -> bytes:
    """The added cubin of a container as the rewritten file stores it, decompressed."""
    layout = read_layout(new, work.name)
    order = [r.container for r in work.layout.registrations].index(container)
    now = layout.containers[layout.registrations[order].container]
    entry = now.described[len(work.layout.containers[container].entries)]
    return entry_payload(new, entry, work.name)


def _code(cubin: bytes) -> dict[str, bytes]:
    """A cubin's code: its `.text.*` sections (the rest holds ptxas's own notes)."""
    elf = Elf.read(cubin)
    return {s.name: elf.section_data(s) for s in elf.sections if s.name.startswith(".text")}


def _write_new(root: Path, target: Path, data: bytes, mode: int) -> None:
    """Write a file under `root` (--out), never through a link found there (a folder of it
    that is one) and never over one."""
    refuse_links_below(root, target)
    replace_bytes(target, data, mode)


def _aot_wheel(source: Path, request: AotRequest, outcome: AotResult) -> None:
    """A wheel: its rewritten members in a copy under --out, RECORD updated (sha256 and
    size of each), every other member byte for byte."""
    with zipfile.ZipFile(source) as wheel:
        infos = wheel.infolist()
        works: list[FileWork] = []
        for info in infos:
            if info.is_dir() or not (info.filename.endswith(".so") or ".so." in info.filename):
                continue
            data = wheel.read(info)
            if data[:4] != ELF_MAGIC:
                continue
            mode = (info.external_attr >> 16) or 0o755
            work = _plan(f"{source.name}!{info.filename}", data, mode, request.target,
                         outcome)
            if work is not None:
                works.append(work)
        replaced = {w.name.split("!", 1)[1]: new
                    for w, new in _compile_and_rewrite(works, request, outcome)}
        if not replaced:
            return
        target = request.out / source.name
        refuse_links_below(request.out, target)
        _write_wheel(wheel, infos, replaced, target)
        outcome.written.append(target)


def _write_wheel(wheel: zipfile.ZipFile, infos: list[zipfile.ZipInfo],
                 replaced: dict[str, bytes], target: Path) -> None:
    record = next((i.filename for i in infos if i.filename.endswith(".dist-info/RECORD")),
                  None)
    if record is None:
        raise Sm121Error(f"{wheel.filename}: no .dist-info/RECORD: not a wheel")
    lines = []
    for row in wheel.read(record).decode().splitlines():
        path = row.rsplit(",", 2)[0]
        if path in replaced:
            digest = base64.urlsafe_b64encode(hashlib.sha256(replaced[path]).digest())
            row = f"{path},sha256={digest.rstrip(b'=').decode()},{len(replaced[path])}"
        lines.append(row)

    def write(out: BinaryIO) -> None:
        with zipfile.ZipFile(out, "w") as copy:
            for info in infos:
                if info.filename == record:
                    copy.writestr(info, "\n".join(lines) + "\n")
                elif info.filename in replaced:
                    copy.writestr(info, replaced[info.filename],
                                  compress_type=zipfile.ZIP_DEFLATED)
                else:
                    with wheel.open(info) as member, copy.open(info, "w") as to:
                        while chunk := member.read(1 << 20):
                            to.write(chunk)

    replace_file(target, write, stat.S_IMODE(os.stat(str(wheel.filename)).st_mode))


def say_results(outcome: AotResult) -> None:
    for item in outcome.files:
        result(f"{item.name}: {item.modules} module(s) native now; +{human_size(item.sass_bytes)}"
               f" of SASS stored as {human_size(item.entry_bytes)} (zstd); file "
               f"{human_size(item.stock_size)} -> {human_size(item.new_size)}")
    for line in outcome.failed:
        click.echo(f"error: {line}", err=True)
    if outcome.files:
        note(f"aot: {len(outcome.files)} file(s), {outcome.cpu_seconds:.0f} CPU-s of "
             f"ptxas, {duration(outcome.wall_seconds)} in all")

