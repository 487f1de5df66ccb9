"""A source tree is read and patched only inside itself: no link may lead out of it.

A symlink in a tree (a file, or a whole folder such as `cmake/` or
`cmake/external_projects/`) that resolves outside the tree would make a patch write through
it into a file that is not the tree's, a guard scan read (or silently skip) files the build
never sees, and a copy into the build context carry what it points to.  So every tree the
tool reads is walked first (`.git` aside, which the tool never reads through links) and one
link leaving it is refused with one line naming it.  Links that stay inside are kept: a
patch writes through them to the file they name (`cmake_lang.real_file`).
"""

from __future__ import annotations

import os
from pathlib import Path

from sm121_build.core.errors import Sm121Error
from sm121_build.core.inputs import walk

SKIPPED = frozenset({".git"})


class LinkLeavesTree(Sm121Error):
    """A symlink in a source tree resolves outside it (or nowhere the tree holds)."""


def require_contained(tree: Path) -> None:
    """Refuse `tree` when any symlink in it resolves outside it, naming the first found
    (in a sorted walk, so the same tree always names the same link)."""
    root = tree.resolve()
    for folder, dirs, files in walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED or Path(folder) != root)
        for name in sorted([*dirs, *files]):
            path = Path(folder) / name
            if not path.is_symlink():
                continue
            rel = path.relative_to(root).as_posix()
            try:
                target = path.resolve(strict=True)
            except FileNotFoundError:
                continue  # dangling: nothing is read or written through it
            except (OSError, RuntimeError):  # a loop of links
                raise Sm121Error(f"{tree}: {rel}: Too many levels of symbolic links (a loop "
                                 "of links): refused") from None
            if not target.is_relative_to(root):
                raise LinkLeavesTree(
                    f"{tree}: {rel} is a link to {os.readlink(path)}, which leads out of the "
                    "source tree: refused (replace the link by the files it names)")
