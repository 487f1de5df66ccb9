"""`sm121-build aot`: native SASS from the PTX a binary already ships, with no source.

For every fatbin container of a file whose code does not load natively on the GPU but has
PTX it can JIT, ptxas compiles that PTX for the GPU ahead of time (what the driver's JIT does
at first start: the same PTX, the default optimisation, the options the entry records) and
the cubin is added to that container (`cuda/fatbin_rewrite`).  Modules compile on every
core in the order and on the threads `cuda/ptxas_schedule` chooses from their estimated
costs (`cuda/ptxas_cost`), within the memory left (`jobs/aot_work/aot_compile` runs it).
Each rewritten file is verified
against its stock file (`verify/aot_check`) and one module per file is compiled again and
its code compared, before anything is written; a file that cannot be rewritten is one line,
and is left as it was.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
import struct
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import BinaryIO

from sm121_build.audit.unpack import archive_kind
from sm121_build.core.console import note, notice, report_error, result, shown
from sm121_build.core.errors import CorruptBinaryError, ToolchainError
from sm121_build.core.inputs import (
    InputRefused,
    kind_of,
    map_input,
    open_file,
    read_head,
    read_input,
    walk,
)
from sm121_build.core.outputs import Results
from sm121_build.core.paths import state_dir, store_bytes
from sm121_build.core.units import duration, human_size
from sm121_build.cuda.binary import (
    NOT_A_SHARED_OBJECT,
    aot_reach,
    jit_ptx,
    unreachable_words,
)
from sm121_build.cuda.compat import Target
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.cuda.elf import Elf, ElfError
from sm121_build.cuda.fatbin import MAX_ENTRY_SIZE, entry_payload, read_entries, read_entry
from sm121_build.cuda.fatbin_rewrite import (
    Layout,
    entry_options,
    read_layout,
    rewrite,
)
from sm121_build.cuda.ptxas import (
    Compile,
    Toolchain,
    arch_for,
    checked_options,
    compile_ptx,
    fatbin_entry,
    newer_isa_words,
    run_ptxas,
)
from sm121_build.cuda.ptxas_cost import Estimate, cost_table, digest, ptx_kind
from sm121_build.cuda.wheel import (
    copy_wheel,
    elf_members,
    read_record,
    record_text,
    require_recorded,
    wheel_errors,
)
from sm121_build.jobs.aot_work.aot_compile import Compiled, CompileInputs, compile_all, kept_pace
from sm121_build.verify.aot_check import check_aot


@dataclass
class CacheDoubts:
    """Cache entries a run would not use (not written by this tool, or changed since), and
    those it compiled but could not vouch for (their digest not written: the state folder
    cannot be written), so did not keep: each said once, at the end of the run."""

    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    unkept: int = 0

    def add(self) -> None:
        with self.lock:
            self.count += 1

    def not_kept(self) -> None:
        with self.lock:
            self.unkept += 1


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
    doubts: CacheDoubts = field(default_factory=CacheDoubts)
    split: bool = True  # ptxas's --split-compile for a module that would set the wall


@dataclass(frozen=True)
class Module:
    """One PTX entry to compile: which file and container it belongs to, and what ptxas is
    expected to take for it (`ptxas_cost`)."""

    file: int
    container: int
    ptx: bytes
    options: tuple[str, ...]
    arch: str
    cost: Estimate = field(default_factory=Estimate)
    digests: tuple[str, ...] = ()  # of the entry as stored, and of the PTX text


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
class AotFileResult:
    """One file aot made native: its name, the modules compiled, its size before and after,
    and the SASS it gained (what `say_results` reports)."""

    name: str
    modules: int
    stock_size: int
    new_size: int
    sass_bytes: int  # the new cubins, uncompressed
    entry_bytes: int  # the new entries as stored (compressed)


@dataclass(frozen=True)
class ModuleResult:
    """One compiled module: its file and container, PTX size, the CPU-seconds the estimate
    expected (the table's, `ptxas_cost`) and those ptxas took (0: from cache)."""

    file: str
    container: int
    ptx_bytes: int
    predicted: float
    cpu_seconds: float
    digests: tuple[str, ...]  # of the entry as stored, and of the PTX text
    kind: str  # `ptxas_cost.ptx_kind`


@dataclass
class AotResult:
    files: list[AotFileResult] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0  # ptxas's, each process's own (`wait4`)
    modules: list[ModuleResult] = field(default_factory=list)
    wall_seconds: float = 0.0
    written: list[Path] = field(default_factory=list)


def run_aot(request: AotRequest) -> AotResult:
    """Every input planned, each result's path claimed (before any work: two results never
    share a path, none is an input), then compiled and written; a file that fails is one
    line in `failed` and every other file is still done."""
    started = time.monotonic()
    outcome = AotResult()
    results = Results(request.out, request.inputs)
    wheels = [s for s in request.inputs  # a wheel by the audit's rule: a zip by its bytes
              if kind_of(s) == "file" and archive_kind(s) == "zip"]
    files = [found for source in request.inputs if source not in wheels
             for found in _elf_files(source, outcome)]
    targets = {path: results.claim(relative, str(path)) for path, relative in files}
    wheel_targets = {wheel: results.claim(Path(wheel.name), str(wheel)) for wheel in wheels}
    _aot_files(targets, request, outcome, results)
    for wheel, target in wheel_targets.items():
        try:
            with wheel_errors(wheel):
                _aot_wheel(wheel, target, request, outcome, results)
        except CorruptBinaryError as exc:
            outcome.failed.append(str(exc))
    if request.doubts.count:
        notice(f"aot: {request.doubts.count} cached module(s) were not written by this tool "
               "or changed since (no matching digest in its state folder): compiled again")
    if request.doubts.unkept:
        notice(f"aot: the state folder {state_dir()} cannot be written: "
               f"{request.doubts.unkept} compiled module(s) not kept in the cache (an entry "
               "is kept only with its digest there)")
    outcome.wall_seconds = time.monotonic() - started
    return outcome


MAX_FILE = 1 << 34  # 16 GiB: a larger file is not a CUDA extension (torch's largest: ~1.5 GB)


def _aot_files(targets: dict[Path, Path], request: AotRequest, outcome: AotResult,
               results: Results) -> None:
    """.so files and folders of them, compiled as one batch: each rewritten file at its
    claimed path under --out."""
    works: list[FileWork] = []
    names: dict[str, Path] = {}
    for path, target in targets.items():
        try:
            if not _worth_reading(path, request.target, outcome):
                continue
            data = read_input(path, MAX_FILE)
            mode = os.stat(path).st_mode
        except (InputRefused, OSError) as exc:
            outcome.failed.append(str(exc))
            continue
        work = _layout_of(str(path), data, mode, request.target, outcome)
        if work is not None:
            works.append(work)
            names[work.name] = target
    for work, new in _compile_and_rewrite(works, request, outcome):
        target = names[work.name]
        results.write(target, partial(_write_bytes, new), stat.S_IMODE(work.mode))
        outcome.written.append(target)


def _worth_reading(path: Path, target: Target, outcome: AotResult) -> bool:
    """Whether a file is an ELF file with a `.nv_fatbin` section, from its headers alone (a
    map of it: only the pages of the headers are read), so a large file with no device code
    is never read whole; a file that is no readable ELF file is one line in `failed`.  A
    file whose JIT-only code lies only where aot cannot reach it (cuFFT's `.data`) is said
    in one notice, never passed over as "nothing to compile"."""
    data, _size = map_input(path)
    try:
        elf = _readable_elf(str(path), data, outcome)
        if elf is None:
            return False
        if elf.section(".nv_fatbin") is not None:
            return True
        try:
            raw, entries = read_entries(path, data)
        except CorruptBinaryError:
            return False  # only what aot would rewrite is judged here
        reach = aot_reach(None, entries, raw, target)
        if reach.unreachable:
            notice(f"{path}: {unreachable_words(reach.unreachable)}")
        return False
    finally:
        if not isinstance(data, bytes):
            data.close()


def _readable_elf(name: str, data: bytes | mmap.mmap, outcome: AotResult) -> Elf | None:
    """The file's section table; None, with one line in `failed`, when it is no readable
    ELF file (as `audit` refuses it), never "nothing to compile"."""
    if data[:4] != ELF_MAGIC:
        outcome.failed.append(f"{name}: not an ELF file: {NOT_A_SHARED_OBJECT}")
        return None
    try:
        return Elf.read(data)
    except ElfError as exc:
        outcome.failed.append(f"{name}: not a readable ELF file (truncated?): {exc}")
        return None


def _write_bytes(data: bytes, out: BinaryIO) -> None:
    out.write(data)


def _elf_files(source: Path, outcome: AotResult) -> Iterator[tuple[Path, Path]]:
    """(path, path relative to what was given) of the files to aot: a file given by name
    whatever it holds (one that is no ELF file is said, as the audit says it), the ELF files
    of a folder; links inside a folder are not followed, and what is not a regular file
    there is skipped and said."""
    if kind_of(source) == "file":
        yield source, Path(source.name)
        return
    for root, dirs, files in walk(source):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if path.is_symlink():
                continue
            try:
                head = read_head(path, 4)
            except InputRefused as exc:
                notice(f"skipped: {exc}")
                continue
            if head == ELF_MAGIC:
                yield path, path.relative_to(source)


def _layout_of(name: str, data: bytes, mode: int, target: Target,
          outcome: AotResult) -> FileWork | None:
    """The file's layout when it has JIT-only containers aot compiles (`aot_reach`, the
    rule the audit's "aot-able" uses); None when it has none (host code only, everything
    native already).  A file that is no readable ELF file, or one aot would have to refuse,
    is one line in `failed`; JIT-only code aot cannot reach is one notice."""
    elf = _readable_elf(name, data, outcome)
    if elf is None or elf.section(".nv_fatbin") is None:  # host code only
        return None
    try:
        raw, entries = read_entries(Path(name), data)
        reach = aot_reach(data, entries, raw, target)
        if reach.unreachable:
            notice(f"{name}: {unreachable_words(reach.unreachable)}")
        if reach.refused:
            outcome.failed.append(f"{name}: {reach.refused}")
            return None
        if not reach.chosen:
            return None
        return FileWork(name, data, read_layout(data, name), mode)
    except CorruptBinaryError as exc:
        outcome.failed.append(str(exc))
        return None


def _modules(works: list[FileWork], request: AotRequest,
             outcome: AotResult) -> list[Module]:
    modules = []
    for number, work in enumerate(works):
        try:
            modules += _file_modules(number, work, request, outcome)
        except CorruptBinaryError as exc:  # one bad entry: this file is left, the rest done
            outcome.failed.append(f"{exc}; {work.name} left as it was"
                                  if work.name in str(exc) else f"{work.name}: {exc}")
    return sorted(modules, key=lambda m: -m.cost.cpu_seconds)


def _file_modules(number: int, work: FileWork, request: AotRequest,
                  outcome: AotResult) -> list[Module]:
    """The modules of one file; a damaged entry is a `CorruptBinaryError` for the whole
    file (half a file is never written)."""
    modules = []
    for index, container in enumerate(work.layout.containers):
        entry = jit_ptx(container.described, request.target)
        if entry is None:
            continue
        raw = container.entries[container.described.index(entry)]
        if entry.version > request.toolchain.newest_isa:
            outcome.failed.append(f"{work.name}: container {index}: "
                                  f"{newer_isa_words(entry.version, request.toolchain)}")
            continue
        try:
            options = tuple(checked_options(entry_options(raw)))
        except ToolchainError as exc:
            outcome.failed.append(f"{work.name}: container {index}: {exc}")
            continue
        ptx = entry_payload(work.data, entry, work.name)
        digests = (digest(work.data[entry.offset:entry.offset + entry.stored_size]),
                   digest(ptx.rstrip(b"\0")))
        cost = cost_table().cost(len(ptx), digests, ptx_kind(ptx))
        modules.append(Module(number, index, ptx, options,
                              arch_for(request.target, entry.variant), cost, digests))
    return modules


def _compile_and_rewrite(works: list[FileWork], request: AotRequest,
                         outcome: AotResult) -> Iterator[tuple[FileWork, bytes]]:
    modules = _modules(works, request, outcome)
    if not modules:
        return
    pace = kept_pace(request.toolchain.version)
    estimate = sum((m.cost for m in modules), Estimate()).scaled(pace)
    largest = max(m.cost.cpu_seconds for m in modules) * pace
    note(f"aot: {len(modules)} PTX module(s) in {len({m.file for m in modules})} file(s), "
         f"{human_size(sum(len(m.ptx) for m in modules))} of PTX, for {request.target} with "
         f"{request.toolchain}; {estimate.words()}, the costliest module {largest:,.0f}; on "
         f"{request.jobs} core(s), costliest first"
         + (", split with --split-compile where one would set the wall" if request.split
            else ""))
    inputs = CompileInputs(tuple(m.cost for m in modules), tuple(len(m.ptx) for m in modules),
                request.jobs, request.split, pace, request.toolchain.version)
    failed_files: set[int] = set()
    for index, done in compile_all(inputs, partial(_compile_one, modules, request)):
        module = modules[index]
        work = works[module.file]
        if isinstance(done, ToolchainError):
            outcome.failed.append(f"{work.name}: container {module.container}: {done}")
            failed_files.add(module.file)
            continue
        work.cubins[module.container], work.entries[module.container] = done.cubin, done.entry
        outcome.cpu_seconds += done.cpu_seconds
        outcome.modules.append(ModuleResult(work.name, module.container, len(module.ptx),
                                            module.cost.cpu_seconds, done.cpu_seconds,
                                            module.digests, ptx_kind(module.ptx)))
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
        outcome.files.append(AotFileResult(work.name, len(work.entries), len(work.data),
                                        len(new), sass, stored))
        yield work, new


def _compile_one(modules: list[Module], request: AotRequest, index: int,
                 threads: int) -> Compiled:
    """The module's cubin and fatbin entry: from the cache when this tool compiled this PTX
    with these options for this GPU with this ptxas before, and the entry is unchanged since
    (its digest, kept in the state folder when it was written, says so), else compiled now
    (on `threads` threads) and kept with its digest."""
    module = modules[index]
    key = hashlib.sha256(b"\0".join([module.ptx, module.arch.encode(),
                                      " ".join(module.options).encode(),
                                      request.toolchain.version.encode()])).hexdigest()
    if request.cache is not None:
        cached = _cached_entry(request.cache / key[:2] / key, _digest_path(key), module,
                               request.doubts)
        if cached is not None:
            return Compiled(*cached, 0.0)
    ran = run_ptxas(request.toolchain, module.ptx,
                    Compile(module.arch, module.options, threads, request.timeout))
    entry = fatbin_entry(request.toolchain, ran.cubin, module.arch.removeprefix("sm_"),
                         request.timeout)
    if request.cache is not None:  # an entry is kept only once its digest is
        if store_bytes(_digest_path(key), hashlib.sha256(entry).hexdigest().encode()):
            store_bytes(request.cache / key[:2] / key, entry)
        else:
            request.doubts.not_kept()
    return Compiled(ran.cubin, entry, ran.cpu_seconds)


def _digest_path(key: str) -> Path:
    """Where the digest of the cache entry `key` is kept: the state folder, which no cache
    restore (a CI's actions/cache, a copied ~/.cache) brings along."""
    return state_dir() / "aot-cache-digests" / key[:2] / key


def _cached_entry(path: Path, digest_at: Path, module: Module,
                  request_doubts: CacheDoubts) -> tuple[bytes, bytes] | None:
    """A cached entry whose digest this tool recorded when it wrote it, still unchanged,
    that reads as a cubin for the module's GPU, with that cubin; None (and counted when an
    entry was there) otherwise."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        recorded = read_input(digest_at, 64, "aot cache digest").decode("ascii")
        entry = read_input(path, MAX_ENTRY_SIZE, "aot cache entry")
        if hashlib.sha256(entry).hexdigest() != recorded:
            raise CorruptBinaryError(f"{path}: changed since it was written")
        described, _end = read_entry(path, entry, 0, len(entry))
        if described is None or described.kind != "elf" or \
                f"sm_{described.arch}" != module.arch.rstrip("a"):
            raise CorruptBinaryError(f"{path}: not a cubin for {module.arch}")
        cubin = entry_payload(entry, described, str(path))
        if cubin[:4] != ELF_MAGIC:
            raise CorruptBinaryError(f"{path}: not a cubin")
        return cubin, entry
    except (InputRefused, CorruptBinaryError, UnicodeDecodeError, struct.error, OSError):
        request_doubts.add()
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
    try:
        elf = Elf.read(cubin)
        return {s.name: elf.section_data(s) for s in elf.sections
                if s.name.startswith(".text")}
    except ElfError as exc:
        raise CorruptBinaryError(f"an added cubin is not a readable ELF file: {exc}") from None


def _aot_wheel(source: Path, target: Path, request: AotRequest, outcome: AotResult,
               results: Results) -> None:
    """A wheel: its rewritten members in a copy at `target`, RECORD updated (sha256 and
    size of each, read and written as CSV), every other member byte for byte.  The wheel's
    members by the one rule (`cuda/wheel.checked_members`) and its RECORD (read once, a row
    for every member to compile) are checked before anything is compiled; a member is read
    only when its first bytes are an ELF header whose declared extent holds its size."""
    with open_file(source, "wheel") as handle, zipfile.ZipFile(handle) as wheel:
        infos = wheel.infolist()
        works: list[FileWork] = []
        member: dict[str, str] = {}  # a work's name (WHEEL!MEMBER) -> its member: never
        # split back (an epoch's `!` in the wheel's version, any `!` in a member's name)
        for info, data in elf_members(wheel, source):
            mode = (info.external_attr >> 16) or 0o755
            work = _layout_of(f"{source.name}!{info.filename}", data, mode, request.target,
                         outcome)
            if work is not None:
                works.append(work)
                member[work.name] = info.filename
        if not works:
            return
        record_name, rows = read_record(wheel, infos, source)
        require_recorded(rows, {member[w.name]: w.data for w in works}, source)
        replaced = {member[w.name]: new
                    for w, new in _compile_and_rewrite(works, request, outcome)}
        if not replaced:
            return
        record = (record_name, record_text(rows, replaced))
        results.write(target, lambda out: copy_wheel(wheel, infos, replaced, record, out),
                      stat.S_IMODE(os.fstat(handle.fileno()).st_mode))
        outcome.written.append(target)


def say_results(outcome: AotResult) -> None:
    for item in outcome.files:
        result(f"{shown(item.name)}: {item.modules} module(s) native now; "
               f"+{human_size(item.sass_bytes)} of SASS stored as "
               f"{human_size(item.entry_bytes)} (zstd); file "
               f"{human_size(item.stock_size)} -> {human_size(item.new_size)}")
    for line in outcome.failed:
        report_error(line)
    if outcome.files:
        note(f"aot: {len(outcome.files)} file(s), {outcome.cpu_seconds:.0f} CPU-s of "
             f"ptxas, {duration(outcome.wall_seconds)} in all")

