"""Turn an audit target (.so, directory, wheel, image tarball, engine image) into ELF files.

Whatever has to be unpacked goes to one temporary directory that is removed on exit,
error or Ctrl-C included.  An image in the engine is streamed, never exported: only the
directories the `--include` patterns can match are read (a pattern's fixed leading folders;
a pattern that starts with `*/NAME` is looked for under the image's Python package
directories, where vLLM lives), the whole filesystem only when no pattern has a fixed part.
Of a folder or an engine image, only ELF files that carry device code stay in temp (the
others are dropped once read, listed by name and size); a wheel's or an image tarball's
wanted members are extracted whole, within the archive's budget (`core/inputs.Inflated`).
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import stat
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import click
from isal import isal_zlib

from sm121_build.audit.distributions import SHARED_OBJECT, Owners
from sm121_build.core.console import Progress, notice, shown
from sm121_build.core.errors import CorruptBinaryError, Sm121Error
from sm121_build.core.inputs import (
    Inflated,
    InputRefused,
    open_file,
    read_head,
    read_input,
    walk,
)
from sm121_build.core.interrupts import held, temp_dir
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.cuda.elf import declared_extent
from sm121_build.cuda.fatbin import RAW_PROBE, HostBinary, device_file_kind
from sm121_build.cuda.wheel import (
    HEAD_WINDOW,
    MAX_RECORD,
    checked_members,
    is_record,
    member_chunks,
    member_name,
    require_honest_size,
    wheel_name,
)
from sm121_build.image import layers
from sm121_build.image.refs import looks_like_image_ref, names_a_file
from sm121_build.image.spill import write_stream

if TYPE_CHECKING:
    from sm121_build.image.api import ImageEngine, ImageFiles, ImageInfo

# ISA-L's inflate raises its own error on a damaged deflate stream (its stubs declare an
# instance, not the class)
ISAL_ERROR: type[Exception] = type(isal_zlib.error) if not isinstance(isal_zlib.error, type) \
    else isal_zlib.error
GLOB_CHARS = re.compile(r"[*?\[]")

@dataclass(frozen=True)
class AuditedFile:
    """An ELF file to audit: the name to show and where its bytes are now."""

    name: str
    path: Path
    host_only_size: int | None = None  # set when the file was dropped: an ELF of no device code
    skipped: str | None = None  # why it could not be audited (unreadable, outside the archive)
    package: str | None = None  # the distribution that installs it (its RECORD, its wheel)
    claimed_by: tuple[str, ...] = ()  # every distribution whose RECORD lists it (its wheel's)


def _wanted(include: tuple[str, ...]) -> Callable[[str], bool]:
    def wanted(path: str) -> bool:
        if not SHARED_OBJECT.search(path):
            return False
        # paths are relative; a pattern may also name them absolutely (`/opt/x/*`)
        return not include or any(fnmatch.fnmatch(path, pattern) or
                                  fnmatch.fnmatch("/" + path, pattern) for pattern in include)
    return wanted


class Reading(NamedTuple):
    """How `audit` reads a target: the paths it keeps (globs; none: every shared object),
    the platform of a multi-platform tarball, whether progress is shown, and who hears of
    each file with device code kept from an image's stream as soon as it is on disk (the
    audit starts reading it while the stream goes on)."""

    include: tuple[str, ...] = ()
    platform: str | None = None
    progress: bool = False
    on_kept: Callable[[AuditedFile], None] | None = None


READ_ALL = Reading()  # every shared object and device file, quietly


@contextmanager
def binaries(target: str, reading: Reading = READ_ALL,
             engine: Callable[[], ImageEngine] | None = None) -> Iterator[list[AuditedFile]]:
    """Yield the ELF files a target holds; temporary copies are removed afterwards."""
    path = Path(target)
    wanted = _wanted(reading.include)
    if path.is_dir():
        folder = _walk(path, wanted)
        if not folder.archives:
            yield _owned(folder.found, folder.owners)
            return
        with temp_dir("sm121-audit-") as tmp:
            yield _owned(folder.found + _expand(folder.archives, Path(tmp), wanted),
                         folder.owners)
        return
    if path.exists() and not path.is_file():
        raise Sm121Error(f"{path}: not a regular file (a FIFO, socket or device); audit reads "
                         "files, directories, wheels, image tarballs and images")
    if path.is_file():
        if is_auditable(path):
            yield [AuditedFile(str(path), path)]
            return
        with temp_dir("sm121-audit-") as tmp:
            kind = archive_kind(path)
            if kind is None:
                raise Sm121Error(
                    f"{path}: not an ELF file, wheel, or image tarball; audit takes one of "
                    "those, a directory, or an image in the local Docker engine")
            yield _archive(path, kind, Path(tmp), reading)
        return
    if names_a_file(target):
        raise Sm121Error(f"{target}: no such file or directory")
    if not looks_like_image_ref(target):
        raise Sm121Error(f"{target}: no such file, and not a valid image reference")
    if engine is None:
        from sm121_build.image.engine import (
            Engine,  # the Docker SDK is imported only when an image is read
        )

        engine = Engine.connect
    connected = engine()
    info = connected.image(target)
    with temp_dir("sm121-audit-") as tmp:
        progress = Progress(f"reading {target}")  # live on a terminal, else plain lines
        with connected.reader(info.id, progress.add) as files:
            found = _stream_image(info, files, reading, Path(tmp), progress)
        progress.done()
        yield found


ARCHIVE_ERRORS = (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error, ISAL_ERROR,
                  NotImplementedError, ValueError)  # zipfile's "zip file version 12.6", a
# name flagged UTF-8 that is not


def _archive(path: Path, kind: str, dest: Path, reading: Reading) -> list[AuditedFile]:
    """A wheel's or an image tarball's files to audit, each named by the distribution
    that installs it: a wheel's own, or the RECORD of the image's `.dist-info` that lists
    it."""
    wanted = _wanted(reading.include)
    try:
        if kind == "zip":
            found = _unzip(path, dest, wanted)  # its name by the one rule, as aot's
            named = wheel_name(path)
            owner = named.distribution if named is not None else None
            return [replace(b, package=owner, claimed_by=(owner,) if owner else ())
                    for b in found]
        owners = Owners()
        found = _untar(path, dest, lambda p: wanted(p) or is_record(p), reading, owners)
        return _owned(found, owners)
    except ARCHIVE_ERRORS as exc:
        raise CorruptBinaryError(f"{path}: damaged archive ({exc})") from None


def _expand(archives: list[tuple[str, Path]], dest: Path,
            wanted: Callable[[str], bool]) -> list[AuditedFile]:
    """The wheels and tarballs of a folder, each audited as its own (members named
    `ARCHIVE!MEMBER`); one that cannot be read (damaged, refused, a tarball that is not an
    image's) is listed with why, never passed over, and stops none of the others: whatever
    `_archive` refuses is about that one archive."""
    found: list[AuditedFile] = []
    for number, (rel, archive) in enumerate(archives):
        kind = archive_kind(archive)
        if kind is None:
            found.append(AuditedFile(rel, archive, skipped="named as an archive, but neither a "
                                "wheel (zip) nor a tarball"))
            continue
        try:
            inner = _archive(archive, kind, dest / str(number), Reading())
        except Sm121Error as exc:  # `image/layers`: "not a docker-save or OCI image
            # tarball", "holds several platforms"; a damaged or refused wheel
            found.append(AuditedFile(rel, archive, skipped=str(exc).removeprefix(f"{archive}: ")))
            continue
        found += [replace(b, name=f"{rel}!{b.name.lstrip('/')}") for b in inner
                  if wanted(b.name.lstrip("/")) or b.skipped]
    return found


def _owned(found: list[AuditedFile], owners: Owners) -> list[AuditedFile]:
    """Each file with the distribution whose RECORD lists it, where one does; a RECORD that
    could not be read is said (its files keep their folder's name), and so is a file the
    RECORDs of two or more distributions list (a warning naming them all, and the one it is
    counted under)."""
    for line in owners.unreadable:
        notice(f"unreadable: {line} (its files are named by their folder)")
    owned = []
    for binary in found:
        if binary.package:
            owned.append(binary)
            continue
        name = binary.name.lstrip("/")
        claims = owners.claims(name)
        owner = owners.owner(name)
        if len(claims) > 1:
            notice(f"warning: {binary.name} is listed by the RECORDs of {len(claims)} "
                   f"distributions ({', '.join(claims)}): counted under {owner}")
        owned.append(replace(binary, package=owner, claimed_by=claims))
    return owned


TAR_MAGICS = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")


def archive_kind(path: Path) -> str | None:
    """"zip", "tar" (plain or compressed) or None, from the first block only: tarfile's own
    probe reads a file of zeros to its end (50 GB of a sparse file)."""
    head = read_head(path, 512, "archive")
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    with open_file(path, "archive") as handle:
        if zipfile.is_zipfile(handle):  # a zip behind a prefix (a self-extracting one)
            return "zip"
    if head.startswith(TAR_MAGICS):
        return "tar"
    if len(head) == 512 and head[257:262] == b"ustar":
        return "tar"
    if len(head) == 512 and any(head[:100]):  # a pre-POSIX header: its checksum decides
        try:
            stored = int(head[148:156].split(b"\0")[0].strip() or b"-1", 8)
        except ValueError:
            return None
        return "tar" if stored == sum(head[:148]) + 256 + sum(head[156:]) else None
    return None


def walk_roots(include: tuple[str, ...], info: ImageInfo, files: ImageFiles) -> list[str]:
    """The directories (or files) of an image that can hold a path the patterns match."""
    from sm121_build.image.facts import python_sites

    if not include:
        return ["/"]
    roots: list[str] = []
    for pattern in include:
        parts = [p for p in pattern.split("/") if p]
        fixed = _literal_prefix(parts)
        if fixed:
            roots.append("/" + "/".join(fixed))
            continue
        rest = _literal_prefix(parts[1:]) if parts and parts[0] == "*" else []
        if not rest:
            return ["/"]
        found = [c for site in python_sites(info, files)
                 if files.stat(c := posixpath.join(site, *rest)) is not None]
        if not found:  # `*/vllm_flash_attn/*.so`: not at a site's top; read everything
            return ["/"]
        roots += found
    roots = sorted(set(roots))
    return [r for r in roots if not any(r != o and r.startswith(o.rstrip("/") + "/")
                                        for o in roots)]


def _literal_prefix(parts: list[str]) -> list[str]:
    """The leading path segments that hold no glob characters."""
    literal = []
    for part in parts:
        if GLOB_CHARS.search(part):
            break
        literal.append(part)
    return literal


def _stream_image(info: ImageInfo, files: ImageFiles, reading: Reading, dest: Path,
                  progress: Progress) -> list[AuditedFile]:
    """Stream the roots; keep the ELF files `include` wants that carry device code, and list
    the others by name and size only (`host_only_size`), so the table still counts them."""
    include = reading.include
    wanted = _wanted(include)
    found: list[AuditedFile] = []
    kept: set[str] = set()
    owners = Owners()

    def take(rel: str, target: Path) -> None:
        if not is_auditable(target):
            target.unlink()
        elif not _has_device_code(target):
            found.append(AuditedFile("/" + rel, target, target.stat().st_size))
            target.unlink()
        else:
            kept.add(rel)
            found.append(AuditedFile("/" + rel, target))
            progress.update(found=len(found))
            if reading.on_kept is not None:
                reading.on_kept(found[-1])

    links: list[tuple[str, str]] = []  # (wanted path, the file it is a hard link of)
    for root in walk_roots(include, info, files):
        if files.stat(root) is None:
            continue
        parent = posixpath.dirname(root.rstrip("/")) or "/"
        with files.tar(root) as archive:
            for member in archive:
                rel = posixpath.normpath(posixpath.join(parent, member.name)).lstrip("/")
                if is_record(rel) and member.isfile() and member.size <= MAX_RECORD:
                    handle = archive.extractfile(member)
                    if handle is not None:
                        owners.add_record(rel, handle.read(MAX_RECORD))
                    continue
                if not rel or rel == "." or not wanted(rel):
                    continue
                if member.islnk():
                    links.append((rel, posixpath.normpath(posixpath.join(
                        parent, member.linkname)).lstrip("/")))
                    continue
                handle = archive.extractfile(member) if member.isfile() else None
                if handle is not None:
                    write_stream(handle, dest / rel, "/" + rel)
                    take(rel, dest / rel)
    # A hard link names an earlier member, which may not have been kept (another name, not
    # wanted, host-only): read it by its own path once the stream is closed (the engine
    # serves one archive request per container at a time).
    for rel, linked in links:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if linked in kept:
            os.link(dest / linked, target)
            kept.add(rel)
            found.append(AuditedFile("/" + rel, target))
        elif files.copy_file("/" + linked, target) is not None:
            take(rel, target)
        else:
            found.append(AuditedFile("/" + rel, target, skipped=(
                f"hard link to /{linked}, which the image does not hold")))
    return _owned(sorted(found, key=lambda b: b.name), owners)


def _auditable_head(head: bytes) -> bool:
    """An ELF file (host or cubin), a fatbin or PTX text, from its first bytes."""
    return head[:4] == ELF_MAGIC or device_file_kind(head) in ("fatbin", "ptx")


def is_auditable(path: Path) -> bool:
    """What the audit reads: `_auditable_head` of the file (False when it cannot be read)."""
    try:
        return _auditable_head(read_head(path, RAW_PROBE))
    except InputRefused:
        return False


def _has_device_code(path: Path) -> bool:
    try:
        with HostBinary.open(path) as binary:
            return bool(binary.entries)
    except Sm121Error:
        return True  # let the audit itself report it


@dataclass
class Folder:
    """What a folder holds for the audit: files to read, wheels and tarballs to open, and
    the owners its `.dist-info` RECORDs name."""

    found: list[AuditedFile]
    archives: list[tuple[str, Path]]
    owners: Owners


ARCHIVE_NAME = re.compile(r"\.(whl|tar|tar\.gz|tgz)$")


def _walk(root: Path, wanted: Callable[[str], bool]) -> Folder:
    """Every wanted ELF file under root, every wheel and tarball (opened by the caller),
    every RECORD; a folder or file that cannot be read is listed with the reason
    (`skipped`), never passed over in silence."""
    folder = Folder([], [], Owners())
    found = folder.found

    def unreadable(exc: OSError) -> None:
        where = Path(exc.filename or root)
        rel = where.relative_to(root).as_posix() if where != root else "."
        found.append(AuditedFile(rel + "/", where,
                                 skipped=f"folder not read: {exc.strerror or exc}"))

    for dirpath, dirnames, filenames in walk(root, onerror=unreadable):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            archive = ARCHIVE_NAME.search(name) is not None
            record = is_record(rel)
            if full.is_symlink() or not (wanted(rel) or archive or record):
                continue
            if not stat.S_ISREG(full.lstat().st_mode):  # a FIFO would block the read forever
                notice(f"skipped: {shown(rel)}: not a regular file")
                continue
            try:
                if record:
                    folder.owners.add_record(rel, read_input(full, MAX_RECORD, "RECORD"))
                    continue
                head = b"" if archive else read_head(full, RAW_PROBE)
            except InputRefused as exc:
                why = str(exc).removeprefix(f"{full}: ").removeprefix("cannot open: ")
                found.append(AuditedFile(rel, full, skipped=f"not read: {why}"))
                continue
            if archive:
                folder.archives.append((rel, full))
            elif _auditable_head(head):
                found.append(AuditedFile(rel, full))
    found.sort(key=lambda b: b.name)
    return folder


def _unzip(archive: Path, dest: Path, wanted: Callable[[str], bool]) -> list[AuditedFile]:
    """The wanted members of a wheel the one rule takes (`cuda/wheel.checked_members`:
    else `CorruptBinaryError`, as `aot` refuses it), extracted by one thread per core
    (inflate lets go of the GIL; a wheel's `.so` files are most of its bytes).  The central
    directory is read once: the threads share its `ZipFile` (zipfile seeks and reads a
    member under a lock of its own, and never closes a file object it was handed)."""
    found: list[AuditedFile] = []
    members = []
    with open_file(archive, "wheel") as handle, zipfile.ZipFile(handle) as wheel:
        for info in checked_members(wheel, archive):  # aot's rule: refused whole, or each
            # member's plain name is its own and inside the archive
            if info.is_dir() or not wanted(info.filename):
                continue
            members.append((info, dest / member_name(info.filename)))
        # largest first: the longest member starts at once instead of last
        members.sort(key=lambda member: -member[0].file_size)
        pool = ThreadPoolExecutor(len(os.sched_getaffinity(0)))
        try:
            with held():  # a Ctrl-C inside submit() can start a thread the pool does not
                # know of yet, which no shutdown waits for: it would write into a removed
                # temp folder
                budget = Inflated(archive, os.fstat(handle.fileno()).st_size)
                done = pool.map(partial(_extract, archive, wheel, budget), members)
            found.extend(b for b in done if b is not None)
        finally:  # interrupted: no member is written after this, so the temp folder's
            # removal finds every file (a second Ctrl-C cannot cut the wait short)
            with held():
                pool.shutdown(wait=True, cancel_futures=True)
    return sorted(found, key=lambda b: b.name)


def _extract(archive: Path, wheel: zipfile.ZipFile, budget: Inflated,
             member: tuple[zipfile.ZipInfo, Path]) -> AuditedFile | None:
    """One member written to its path (an own handle: threads do not share a file offset);
    the AuditedFile to audit, a skipped one, or None when it is not device code at all.  Its
    first bytes decide before anything is written: a member that is not device code costs
    one window of memory and no temp space, and an ELF member larger than its headers
    account for is skipped, said, and not written."""
    info, target = member
    try:
        chunks = member_chunks(archive, wheel, info)
        head = b""
        for chunk in chunks:
            head += chunk
            if len(head) >= RAW_PROBE:
                break
        if not _auditable_head(head[:RAW_PROBE]):
            chunks.close()
            return None
        extent = declared_extent(head[:HEAD_WINDOW]) if head[:4] == ELF_MAGIC else None
        if extent is not None and info.file_size > extent:
            chunks.close()
            return AuditedFile(info.filename, target, skipped=(
                f"{info.file_size} bytes, more than the {extent} its ELF headers account for "
                "(not extracted)"))
        require_honest_size(info, archive)  # before it is written out whole
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            budget.take(len(head))
            out.write(head)
            for chunk in chunks:
                budget.take(len(chunk))  # a bomb: the wheel refused, this file removed
                out.write(chunk)
    except (NotImplementedError, RuntimeError, OSError, ValueError) as exc:  # a bad offset
        target.unlink(missing_ok=True)
        return AuditedFile(info.filename, target, skipped=f"not extracted: {exc}")
    except CorruptBinaryError as exc:  # a zip bomb: said, never written
        target.unlink(missing_ok=True)
        if budget.left < 0:
            raise  # the wheel's budget: refused whole
        return AuditedFile(info.filename, target, skipped=f"not extracted: "
                      f"{str(exc).removeprefix(f'{archive}: {info.filename}: ')}")
    return AuditedFile(info.filename, target)


def _untar(archive: Path, dest: Path, wanted: Callable[[str], bool], reading: Reading,
           owners: Owners) -> list[AuditedFile]:
    dest.mkdir(parents=True, exist_ok=True)
    with _bar(reading.progress, None, "reading layers") as bar:
        fs = layers.extract_files(archive, dest, wanted, reading.platform, bar.update)
    for rel in sorted(fs.extracted):
        if is_record(rel):
            try:
                owners.add_record(rel, read_input(dest / rel, MAX_RECORD, "RECORD"))
            except InputRefused as exc:
                owners.unreadable.append(str(exc))
    found = [AuditedFile("/" + p, dest / p) for p in sorted(fs.extracted)
             if not is_record(p) and is_auditable(dest / p)]
    return found + [AuditedFile("/" + p, dest / p, skipped=why)
                    for p, why in sorted(fs.broken.items())
                    if p in fs.files and p not in fs.extracted]


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _bar(enabled: bool, length: int | None, label: str) -> Any:
    if not enabled:
        return _NoBar()
    return click.progressbar(length=length, label=label, file=sys.stderr)
