"""Read an image's final filesystem from its saved layers, without running a container.

Both tarball shapes are handled: `docker save` (manifest.json listing layer paths) and an
OCI image layout (index.json -> manifest -> layer blobs).  Layers are applied in order with
OCI whiteout rules: `.wh.NAME` deletes NAME, `.wh..wh..opq` hides the directory's lower
layers.  https://github.com/opencontainers/image-spec/blob/main/layer.md#whiteouts
"""

from __future__ import annotations

import json
import os
import posixpath
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal, cast

import zstandard

from sm121_build.core.errors import Sm121Error
from sm121_build.core.inputs import Inflated, open_file

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_JSON = 64 << 20  # an index or manifest; real ones are kilobytes
MAX_INDEX_DEPTH = 8  # index -> index -> manifest; real tarballs nest two deep
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _bad(archive: Path, why: str) -> Sm121Error:
    return Sm121Error(f"{archive}: not a docker-save or OCI image tarball ({why})")


def _read_json(outer: tarfile.TarFile, name: str, archive: Path) -> Any:
    member = _members(outer).get(posixpath.normpath(name))
    if member is None:
        raise _bad(archive, f"{name} missing")
    handle = outer.extractfile(member)
    if handle is None:
        raise _bad(archive, f"{name} is not a file")
    if member.size > MAX_JSON:
        raise _bad(archive, f"{name} is {member.size} bytes, more than any image index")
    try:
        return json.load(handle)
    except (ValueError, RecursionError) as exc:
        raise _bad(archive, f"{name} is not JSON: {str(exc)[:80] or type(exc).__name__}") \
            from None


def _members(outer: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """The members by normalised name: `tar -C dir .` writes `./manifest.json`."""
    cached: dict[str, tarfile.TarInfo] | None = getattr(outer, "_sm121_members", None)
    if cached is None:
        cached = {posixpath.normpath(m.name): m for m in outer.getmembers()}
        outer._sm121_members = cached  # type: ignore[attr-defined]
    return cached


def _names(outer: tarfile.TarFile) -> set[str]:
    return set(_members(outer))


def _blob(digest: str) -> str:
    algorithm, _, value = digest.partition(":")
    return f"blobs/{algorithm}/{value}"


def layer_paths(outer: tarfile.TarFile, archive: Path, platform: str | None = None) -> list[str]:
    """Member names of the layer tars, bottom first."""
    try:
        return _layer_paths(outer, archive, platform)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        # a manifest or index of another shape than the image specs give (a field of
        # another type, a missing key)
        raise _bad(archive, f"its index has an unexpected shape ({type(exc).__name__}: "
                            f"{str(exc)[:80]})") from None


def _layer_paths(outer: tarfile.TarFile, archive: Path, platform: str | None) -> list[str]:
    names = _names(outer)
    if "manifest.json" in names:
        manifest = _read_json(outer, "manifest.json", archive)
        if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict) \
                or not isinstance(manifest[0].get("Layers"), list):
            raise _bad(archive, "manifest.json has no Layers")
        if len(manifest) > 1:
            raise Sm121Error(f"{archive}: holds {len(manifest)} images; save one image per tarball")
        _require_platform(outer, manifest[0].get("Config"), platform, archive)
        return [_member_name(outer, str(p), archive) for p in manifest[0]["Layers"]]
    if "index.json" in names:
        document = _read_json(outer, "index.json", archive)
        seen: set[str] = set()
        while not isinstance(document, dict) or "layers" not in document:
            if not isinstance(document, dict):
                raise _bad(archive, "an index or manifest is not a JSON object")
            manifests = document.get("manifests") or []
            if not isinstance(manifests, list) or not all(isinstance(m, dict)
                                                          for m in manifests):
                raise _bad(archive, "an index's manifests is not a list of objects")
            chosen = _choose_manifest(manifests, platform, archive)
            digest = str(chosen["digest"])
            if digest in seen or len(seen) >= MAX_INDEX_DEPTH:
                raise _bad(archive, f"its indexes refer in a loop (at {digest[:19]}…)")
            seen.add(digest)
            document = _read_json(outer, _blob(digest), archive)
        if not isinstance(document["layers"], list):
            raise _bad(archive, "a manifest's layers is not a list")
        config = document.get("config")
        _require_platform(outer, _blob(str(config["digest"])) if isinstance(config, dict)
                          and "digest" in config else None, platform, archive)
        return [_member_name(outer, _blob(str(layer["digest"])), archive)
                for layer in document["layers"]]
    raise _bad(archive, "neither manifest.json nor index.json found")


def _require_platform(outer: tarfile.TarFile, config: object, platform: str | None,
                      archive: Path) -> None:
    """With --platform: the image chosen must be of that platform, as its config says (a
    lone manifest that names none in the index, `docker save`'s); a config that does not
    say is taken as it is."""
    if platform is None or not isinstance(config, str):
        return
    if posixpath.normpath(config) not in _members(outer):
        return
    facts = _read_json(outer, config, archive)
    if not isinstance(facts, dict) or not facts.get("os") or not facts.get("architecture"):
        return
    held = f"{facts['os']}/{facts['architecture']}"
    variant = facts.get("variant")
    if platform not in (held, f"{held}/{variant}" if variant else held):
        raise Sm121Error(f"{archive}: holds no {platform} image (it holds {held})")


def _member_name(outer: tarfile.TarFile, name: str, archive: Path) -> str:
    """The member's name as the tarball spells it (`./blobs/…` or `blobs/…`)."""
    member = _members(outer).get(posixpath.normpath(name))
    return member.name if member is not None else name


def _choose_manifest(manifests: list[dict[str, Any]], platform: str | None,
                     archive: Path) -> dict[str, Any]:
    """The manifest of the platform asked for (`os/arch`, or `os/arch/variant`), or the one
    real platform when none is asked for; a platform asked for and not held is refused,
    never read as another.  A lone manifest that names no platform (docker save's) is read
    as it is."""
    if not manifests:
        raise _bad(archive, "index.json lists no manifests")
    found: dict[str, dict[str, Any]] = {}
    for entry in manifests:
        plat = entry.get("platform")
        if plat is None:
            continue
        if not isinstance(plat, dict):
            raise _bad(archive, "a manifest's platform is not an object")
        name = f"{plat.get('os', '?')}/{plat.get('architecture', '?')}"
        if name != "unknown/unknown":  # attestation manifests
            found[name] = entry
            if plat.get("variant"):
                found[f"{name}/{plat['variant']}"] = entry
    if len(manifests) == 1 and not found:
        return manifests[0]
    if platform is not None:
        if platform in found:
            return found[platform]
        raise Sm121Error(f"{archive}: holds no {platform} image (it holds "
                         f"{', '.join(sorted(found)) or 'no platform it names'})")
    real = list({id(entry): entry for entry in found.values()}.values())
    if len(real) == 1:
        return real[0]
    if not found:
        raise _bad(archive, f"{len(manifests)} manifests, none naming its platform")
    raise Sm121Error(f"{archive}: holds several platforms ({', '.join(sorted(found))}); "
                     "pick one with --platform")


def _open_layer(handle: IO[bytes]) -> tarfile.TarFile:
    head = handle.read(4)
    handle.seek(0)
    if head == ZSTD_MAGIC:
        stream = zstandard.ZstdDecompressor().stream_reader(handle)
        return tarfile.open(fileobj=stream, mode="r|")
    return tarfile.open(fileobj=handle, mode="r|*")


def _safe_relpath(name: str) -> str | None:
    path = posixpath.normpath("/" + name).lstrip("/")
    return path or None


@dataclass
class Filesystem:
    """An image's final file list, and where the wanted files were written."""

    root: Path
    files: set[str] = field(default_factory=set)
    extracted: set[str] = field(default_factory=set)
    broken: dict[str, str] = field(default_factory=dict)  # wanted path -> why it is unreadable
    budget: Inflated | None = None  # what the wanted files may hold in all (links included)
    _below: dict[str, set[str]] = field(default_factory=dict)  # folder -> what it holds

    def write(self, source: IO[bytes], target: Path) -> None:
        """A member's bytes to `target`, each chunk taken from the budget first."""
        with source, open(target, "wb") as out:
            while chunk := source.read(1 << 20):
                if self.budget is not None:
                    self.budget.take(len(chunk))
                out.write(chunk)

    def link(self, existing: Path, target: Path) -> None:
        """A hard link's file: the same inode (no second copy on disk), its bytes taken from
        the budget all the same (each name is read again when audited)."""
        if self.budget is not None:
            self.budget.take(existing.stat().st_size)
        target.unlink(missing_ok=True)
        os.link(existing, target)

    def add(self, path: str) -> None:
        """A file of the final filesystem (so far), listed under each folder above it."""
        self.files.add(path)
        child = path
        while child:
            parent = posixpath.dirname(child)
            listed = self._below.setdefault(parent, set())
            if child in listed:
                break  # the folders above are listed already
            listed.add(child)
            child = parent

    def remove(self, path: str, keep_dir: bool = False,
               spare: frozenset[str] | set[str] = frozenset()) -> None:
        """`path` and everything below it leave the list (and the disk); `keep_dir`: only
        what is below (an opaque whiteout); `spare`: files that stay (the whiteout's own
        layer's).  The cost is what is looked at below `path`, never the whole list: a
        layer of many members is read in time linear in them."""
        path = path.rstrip("/")
        doomed: list[str] = []
        kept: list[str] = []
        if not keep_dir and path in self.files:
            (kept if path in spare else doomed).append(path)
        folders = [path]
        while folders:
            for child in self._below.pop(folders.pop(), ()):
                if child in self._below:
                    folders.append(child)
                if child in self.files:
                    (kept if child in spare else doomed).append(child)
        if not keep_dir and path:
            self._below.get(posixpath.dirname(path), set()).discard(path)
        for name in doomed:
            self.files.discard(name)
            if name in self.extracted:
                (self.root / name).unlink(missing_ok=True)
                self.extracted.discard(name)
        for name in kept:  # listed again under their folders
            self.files.discard(name)
            self.add(name)


def extract_files(archive: Path, dest: Path, wanted: Callable[[str], bool],
                  platform: str | None = None,
                  progress: Callable[[int], None] | None = None) -> Filesystem:
    """Apply the layers: list every final file, write those `wanted(path)` accepts to dest.

    Paths are relative, without a leading slash.  Damage anywhere (the outer tarball, its
    index, a layer) is one `Sm121Error` naming the archive, never the tar reader's own.
    """
    try:
        return _extract_files(archive, dest, wanted, platform, progress)
    except (tarfile.TarError, zstandard.ZstdError, EOFError, zlib.error, OSError,
            UnicodeError, MemoryError, SystemError) as exc:  # SystemError: a decoder's own
        raise _bad(archive, f"{type(exc).__name__}: {str(exc)[:120]}") from None


MAX_READ = 256 << 20  # what one read of the outer tarball may ask for (tarfile's own reads
# are blocks, member headers and long names; a layer is streamed in small reads)


class _Capped:
    """The outer tarball as tarfile reads it, with any one read refused past `MAX_READ`:
    a member header that states a long name of gigabytes would have tarfile allocate it."""

    def __init__(self, handle: BinaryIO, archive: Path) -> None:
        self._handle = handle
        self._archive = archive

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > MAX_READ:
            raise _bad(self._archive, f"a member asks for {size} bytes at once (more than "
                                      f"{MAX_READ}): a damaged or crafted header")
        return self._handle.read(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _extract_files(archive: Path, dest: Path, wanted: Callable[[str], bool],
                   platform: str | None,
                   progress: Callable[[int], None] | None) -> Filesystem:
    tarball = open_file(archive, "image tarball")
    fs = Filesystem(dest, budget=Inflated(archive, os.fstat(tarball.fileno()).st_size,
                                          "image tarball"))
    magic = tarball.read(6)
    # plain, gzip'd or bzip2'd, chosen by the magic: never "r:*", which would try lzma, whose
    # decoder's memory (an xz or legacy .lzma header's dictionary) is the file's to choose
    mode: Literal["r:gz", "r:bz2", "r:"] = "r:gz" if magic.startswith(b"\x1f\x8b") else \
        "r:bz2" if magic.startswith(b"BZh") else "r:"
    if magic == b"\xfd7zXZ\x00":
        tarball.close()
        raise _bad(archive, "an xz-compressed tarball (its decoder's memory is the file's "
                            "to choose): decompress it first (xz -d), or give it plain or "
                            "gzip'd")
    tarball.seek(0)
    try:
        outer = tarfile.open(fileobj=cast(BinaryIO, _Capped(tarball, archive)),  # noqa: SIM115
                             mode=mode)  # closed below
    except (tarfile.TarError, OSError) as exc:
        tarball.close()
        raise _bad(archive, str(exc)) from None
    with tarball, outer:
        for layer_name in layer_paths(outer, archive, platform):
            try:
                handle = outer.extractfile(layer_name)
            except KeyError:
                raise _bad(archive, f"layer {layer_name} missing") from None
            if handle is None:
                raise _bad(archive, f"layer {layer_name} is not a file")
            try:
                with handle, _open_layer(handle) as layer:
                    pending = _apply_layer(layer, fs, wanted)
                if pending:  # hard links to files not written: read the layer once more
                    again = outer.extractfile(layer_name)
                    if again is not None:
                        with again, _open_layer(again) as layer:
                            _resolve_links(layer, fs, pending)
                for linked, paths in pending.items():  # links to members the layer lacks
                    for path in paths:
                        if path in fs.files and path not in fs.extracted:
                            fs.broken[path] = (f"hard link to /{linked}, which layer "
                                               f"{layer_name} does not hold: unreadable")
            except (tarfile.TarError, zstandard.ZstdError, OSError, EOFError) as exc:
                raise _bad(archive, f"layer {layer_name} is unreadable: {exc}") from None
            if progress:
                progress(1)
    return fs


def _apply_layer(layer: tarfile.TarFile, fs: Filesystem,
                 wanted: Callable[[str], bool]) -> dict[str, list[str]]:
    """Apply one layer; returns the wanted hard links whose file was not written (the file
    they name -> the links), for `_resolve_links`."""
    pending: dict[str, list[str]] = {}
    this_layer: set[str] = set()
    for member in layer:
        path = _safe_relpath(member.name)
        if path is None:
            continue
        parent, base = posixpath.split(path)
        # a whiteout hides what lower layers hold, never what its own layer holds (in
        # whatever order the layer lists them), as the engine applies it
        if base == OPAQUE:
            fs.remove(parent, keep_dir=True, spare=this_layer)
            continue
        if base.startswith(WHITEOUT):
            fs.remove(posixpath.join(parent, base[len(WHITEOUT):]), spare=this_layer)
            continue
        if member.isdir():
            continue
        fs.remove(path)  # an upper layer's entry replaces whatever was at that path
        fs.add(path)
        this_layer.add(path)
        if not (member.isfile() or member.islnk()) or not wanted(path):
            continue
        target = fs.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if member.islnk():  # a stream cannot seek back: copy the file the link names
            linked = _safe_relpath(member.linkname)
            if linked in fs.extracted:
                fs.link(fs.root / linked, target)
                fs.extracted.add(path)
            elif linked:
                pending.setdefault(linked, []).append(path)
            continue
        source = layer.extractfile(member)
        if source is None:
            continue
        fs.write(source, target)
        target.chmod(member.mode & 0o755 | 0o600)  # the image's mode, readable by us
        fs.extracted.add(path)
    return pending


def _resolve_links(layer: tarfile.TarFile, fs: Filesystem, pending: dict[str, list[str]]) -> None:
    """Write each pending link's data from the member it names (same layer, earlier)."""
    for member in layer:
        path = _safe_relpath(member.name)
        if path not in pending or not member.isfile():
            continue
        links = [p for p in pending.pop(path) if p in fs.files]
        source = layer.extractfile(member) if links else None
        if source is None:
            continue
        first, *others = links
        target = fs.root / first
        fs.write(source, target)
        target.chmod(member.mode & 0o755 | 0o600)
        fs.extracted.add(first)
        for other in others:
            fs.link(target, fs.root / other)
            fs.extracted.add(other)
        if not pending:
            return
