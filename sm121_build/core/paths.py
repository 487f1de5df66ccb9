"""Where the tool keeps what it can recompute (the cache) and what it cannot (the state: the
ledger of images it made, build logs), per the XDG base directory spec."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from sm121_build.core.errors import Sm121Error
from sm121_build.core.outputs import write_below


def _xdg(variable: str, default: str) -> Path:
    """`$VARIABLE/sm121-build`; a relative or empty value is ignored (as the XDG spec says),
    then `$HOME/<default>`, then the passwd entry's home."""
    base = os.environ.get(variable, "")
    if not os.path.isabs(base):
        home = os.environ.get("HOME", "")
        if not os.path.isabs(home) or home.strip("/") == "":
            try:
                home = pwd.getpwuid(os.getuid()).pw_dir
            except KeyError:
                home = ""
        if not os.path.isabs(home) or home.strip("/") == "":
            raise Sm121Error(f"no place for the {'cache' if 'CACHE' in variable else 'state'}: "
                             f"set {variable} or HOME to an absolute path (this user has no "
                             "home directory)")
        base = os.path.join(home, default)
    return Path(base) / "sm121-build"


def cache_dir() -> Path:
    """What can be recomputed (image facts, torch exports, sources): `$XDG_CACHE_HOME`."""
    return _xdg("XDG_CACHE_HOME", ".cache")


def state_dir() -> Path:
    """What cannot: the ledger of images this tool made, the build logs (`$XDG_STATE_HOME`,
    default ~/.local/state), so clearing a cache never makes the tool forget its images."""
    return _xdg("XDG_STATE_HOME", ".local/state")


def store_cache(path: Path, text: str) -> bool:
    """Write the cache atomically; a cache that cannot be written is only a lost speed-up."""
    return store_bytes(path, text.encode())


def store_bytes(path: Path, data: bytes) -> bool:
    """`store_cache` for bytes (threads may store at once: each its own temporary name);
    True when written.  Nothing is written through a link below the cache or state root
    (`outputs.write_below`): a link there (a cache restored from elsewhere, a folder
    swapped by another user) leaves it unwritten."""
    try:
        write_below(_root_of(path), path, data)
    except OSError:
        return False
    return True


def new_state_file(folder: str, prefix: str, suffix: str) -> Path:
    """A new, empty file of its own (`prefix.<random>suffix`, mode 0600) in `folder` below
    the state folder, made through `outputs.write_below`: never through a link below the
    state root.  A link there (or a full disk) is one-line Sm121Error, nothing written."""
    root = state_dir()
    path = root / folder / f"{prefix}.{os.urandom(8).hex()}{suffix}"
    try:
        write_below(root, path, b"")
    except OSError as exc:
        raise Sm121Error(f"cannot make {path.name} in {root / folder}: "
                         f"{exc.strerror or exc}: nothing is written through a link below "
                         f"{root}") from None
    return path


def _root_of(path: Path) -> Path:
    """The cache or state root `path` lies below (links in the user's path to it are the
    user's); for any other path, its own folder."""
    for root in (cache_dir(), state_dir()):
        if root in path.parents:
            return root
    return path.parent
