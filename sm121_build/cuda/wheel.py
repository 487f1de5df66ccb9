"""The one rule for a wheel's members, which `audit` and `aot` both read by: a wheel is
refused whole (`CorruptBinaryError`, one line naming it) when a member has no name, a name
with a control character or a backslash, a name that leaves the archive (absolute, `..`),
or a name that another member also has once spelled plainly (`pkg/a.so`, `pkg/./a.so`,
`pkg//a.so`, the folder `pkg/a.so/`); or when two `.dist-info` folders at its top each hold
a RECORD: pip would not install such a wheel the same way twice, two members would be
extracted onto one path, and a decoy RECORD could be the one updated.  Read once, before
anything is extracted or compiled.  A member that is to be held whole (`require_honest_size`)
and what a reader writes out of one wheel in all (`Inflated`) must not pass `MAX_RATIO`
times the bytes they come from.
"""

from __future__ import annotations

import posixpath
import re
import zipfile
from pathlib import Path

from sm121_build.core.errors import CorruptBinaryError
from sm121_build.core.inputs import MAX_RATIO, RATIO_FLOOR

_ODD = re.compile(r"[\x00-\x1f\x7f\\]")


def member_name(name: str) -> str:
    """A member's name as one plain path (`pkg/./a.so` is `pkg/a.so`), its folder marker
    kept."""
    plain = posixpath.normpath(name)
    return plain + "/" if name.endswith("/") and plain != "." else plain


def require_honest_size(info: zipfile.ZipInfo, source: Path) -> None:
    """Before a member is held whole (aot rewrites it in memory; audit writes it out): one
    that inflates more than `MAX_RATIO` times its stored bytes, past the floor, is refused
    (a zip bomb: a 3 MB wheel that would hold 3 GB)."""
    if info.file_size > RATIO_FLOOR and \
            info.file_size > MAX_RATIO * max(info.compress_size, 1):
        raise CorruptBinaryError(
            f"{source}: {info.filename}: inflates to {info.file_size} bytes from "
            f"{info.compress_size} (more than {MAX_RATIO}x: a zip bomb); refused")


def record_of(infos: list[zipfile.ZipInfo], source: Path) -> str | None:
    """The name of the wheel's RECORD: the one `*.dist-info/RECORD` at its top (PEP 427),
    None when it has none; two at its top are refused (a RECORD deeper in the wheel is a
    file like any other, never the wheel's)."""
    top = [i.filename for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)]
    if len(top) > 1:
        raise CorruptBinaryError(f"{source}: holds two .dist-info folders ({top[0]}, "
                                 f"{top[1]}): not a wheel pip would install the same way "
                                 "twice; refused")
    return top[0] if top else None


def checked_members(wheel: zipfile.ZipFile, source: Path) -> list[zipfile.ZipInfo]:
    """The wheel's members, in its order, once the one rule holds for every one of them."""
    seen: set[str] = set()
    infos = wheel.infolist()
    for info in infos:
        name = info.filename
        why = ""
        if not name:
            why = "a member with no name (a damaged archive)"
        elif _ODD.search(name):
            why = f"a member named {name!r}, with a control character or a backslash"
        else:
            plain = member_name(name)
            if plain.startswith("/") or plain == ".." or plain.startswith("../"):
                why = f"a member {name!r} whose path leaves the archive"
            elif plain.rstrip("/") in seen:  # `pkg/a.so` and the folder `pkg/a.so/` too
                why = f"two members named {plain.rstrip('/')}" + (
                    f" (one spelled {name})" if plain.rstrip("/") != name else "")
            seen.add(plain.rstrip("/"))
        if why:
            raise CorruptBinaryError(f"{source}: holds {why}: not a wheel pip would install "
                                     "the same way twice; refused")
    record_of(infos, source)
    return infos

