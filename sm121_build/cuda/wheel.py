"""The one rule for a wheel's members, which `audit` and `aot` both read by: a wheel is
refused whole (`CorruptBinaryError`, one line naming it) when a member has no name, a name
with a control character or a backslash, a name that leaves the archive (absolute, `..`),
or a name that another member also has once spelled plainly (`pkg/a.so`, `pkg/./a.so`,
`pkg//a.so`): pip would not install such a wheel the same way twice, and two members would
be extracted onto one path.  Read once, before anything is extracted or compiled."""

from __future__ import annotations

import posixpath
import re
import zipfile
from pathlib import Path

from sm121_build.core.errors import CorruptBinaryError

_ODD = re.compile(r"[\x00-\x1f\x7f\\]")


def member_name(name: str) -> str:
    """A member's name as one plain path (`pkg/./a.so` is `pkg/a.so`), its folder marker
    kept."""
    plain = posixpath.normpath(name)
    return plain + "/" if name.endswith("/") and plain != "." else plain


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
            elif plain in seen:
                why = f"two members named {plain}" + (f" (one spelled {name})"
                                                      if plain != name else "")
            seen.add(plain)
        if why:
            raise CorruptBinaryError(f"{source}: holds {why}: not a wheel pip would install "
                                     "the same way twice; refused")
    return infos
