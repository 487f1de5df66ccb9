"""What this tool made on this machine: the images it built and tagged, and the bases its
`--pull` replaced.  `sm121-build prune` removes only what is written here (and still carries
the tool's labels), so it never touches an image the user made or pulled by hand.

Kept as JSON under the state dir (`$XDG_STATE_HOME/sm121-build/ledger.json`, default
~/.local/state), written atomically, and changed under a lock (`ledger.lock` beside it,
flock'd from the read to the write) so two runs at once never lose each other's records.
Clearing the cache does not make the tool forget what it built.  A ledger at the old place
(`$XDG_CACHE_HOME/sm121-build/ledger.json`) is never read: a cache may come from anywhere (a
CI cache restore, a copied ~/.cache), and nothing found in it becomes a record (it is said
once, and left where it is).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from sm121_build.core.console import notice
from sm121_build.core.errors import Sm121Error
from sm121_build.core.inputs import InputRefused, read_input
from sm121_build.core.outputs import NotWritten, held_lock, replace_bytes
from sm121_build.core.paths import cache_dir, state_dir

FORMAT = 1
MAX_LEDGER = 64 << 20  # thousands of runs' entries take a few MB


@dataclass
class Built:
    image_id: str
    tags: list[str]
    base_id: str
    at: float
    base_ref: str = ""  # the base as the user named it ("" in entries from before 0.x)
    content_key: str = ""  # the run's content key ("" for inject and older entries)


@dataclass
class Replaced:
    """A base image whose tag a `--pull` moved to a newer image."""

    ref: str
    image_id: str
    at: float


@dataclass
class Ledger:
    built: list[Built] = field(default_factory=list)
    replaced: list[Replaced] = field(default_factory=list)

    def add_built(self, image_id: str, tags: list[str], base_id: str, base_ref: str = "",
                  content_key: str = "") -> None:
        for entry in self.built:
            if entry.image_id == image_id:
                entry.tags = sorted(set(entry.tags) | set(tags))
                entry.at = time.time()
                entry.base_ref = base_ref or entry.base_ref
                entry.content_key = content_key or entry.content_key
                return
        self.built.append(Built(image_id, sorted(set(tags)), base_id, time.time(), base_ref,
                                content_key))

    def entry(self, image_id: str) -> Built | None:
        return next((b for b in self.built if b.image_id == image_id), None)

    def add_replaced(self, ref: str, image_id: str) -> None:
        if all(r.image_id != image_id for r in self.replaced):
            self.replaced.append(Replaced(ref, image_id, time.time()))


def _path() -> Path:
    """The ledger in the state folder; one in the cache folder is never read (untrusted)."""
    old = cache_dir() / "ledger.json"
    if old.is_file() or old.is_symlink():
        _ignored(old)
    return state_dir() / "ledger.json"


@cache
def _ignored(old: Path) -> None:
    """Said once a run: a ledger in the cache is not this machine's record of its images."""
    notice(f"{old}: a ledger in the cache folder is not read (a cache may have been restored "
           "from elsewhere): only the state folder's ledger lists the images this tool made")


def _typed(item: object, kind: type[Built] | type[Replaced]) -> Built | Replaced | None:
    """One ledger entry as written by `save`, or None for a damaged one (a hand edit, a
    half-written file from another tool)."""
    if not isinstance(item, dict):
        return None
    try:
        entry = kind(**item)
    except TypeError:
        return None
    values = asdict(entry)
    strings = [v for k, v in values.items() if k not in ("at", "tags")]
    tags = values.get("tags", [])
    if not all(isinstance(v, str) for v in strings) or not isinstance(values["at"], int | float) \
            or not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return None
    if not _IMAGE_ID.fullmatch(values["image_id"]) or not math.isfinite(values["at"]) or \
            isinstance(values["at"], bool):
        return None  # an ID the engine never gave (a newline, `..`): never put in a request
    return entry


_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}", re.ASCII)


def load() -> Ledger:
    """The ledger; an empty one where there is none yet.  A damaged one (not JSON, not the
    shape `save` writes, any entry unreadable) is refused with one line and never read as
    empty: the next save would overwrite it, and prune would forget what it listed."""
    path = _path()
    try:
        os.lstat(path)
    except FileNotFoundError:
        return Ledger()
    except OSError as exc:  # a file where the state folder should be: said, never "empty"
        raise Sm121Error(f"{path.parent}: the state folder cannot be used "
                         f"({exc.strerror or exc}): it lists the images this tool made; "
                         "set XDG_STATE_HOME to a folder") from None
    try:
        raw = json.loads(read_input(path, MAX_LEDGER, "the ledger"))
    except InputRefused as exc:
        raise _damaged(path, str(exc).removeprefix(f"{path}: ")) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise _damaged(path, type(exc).__name__) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("built", []), list) or \
            not isinstance(raw.get("replaced", []), list):
        raise _damaged(path, "not the ledger's shape")
    built = [_typed(b, Built) for b in raw.get("built", [])]
    replaced = [_typed(r, Replaced) for r in raw.get("replaced", [])]
    if not all(isinstance(b, Built) for b in built) or \
            not all(isinstance(r, Replaced) for r in replaced):
        raise _damaged(path, "an entry is not one this tool writes")
    return Ledger([b for b in built if isinstance(b, Built)],
                  [r for r in replaced if isinstance(r, Replaced)])


def _damaged(path: Path, why: str) -> Sm121Error:
    return Sm121Error(f"the ledger {path} is damaged ({why}): it is left as it is; move it "
                      f"aside (`mv {path} {path}.damaged`) and run again: sm121-build then "
                      "starts a new one, and `prune` no longer knows the images it listed")


def save(ledger: Ledger) -> None:
    """Write the ledger atomically: a temporary file beside it, fsync'd, renamed over it,
    the folder fsync'd; a write that fails (a full disk) is an error, and the old ledger
    stays."""
    path = _path()
    text = json.dumps({"format": FORMAT, **asdict(ledger)}, indent=2).encode()
    try:
        replace_bytes(path, text)
    except NotWritten as exc:
        raise Sm121Error(f"could not write the ledger {path}: {exc.why}; it "
                         "keeps what it listed before this run (free the disk, then "
                         "`sm121-build prune` knows this run's images only once re-run)") \
            from None


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The ledger's lock (`ledger.lock` in the state folder, `outputs.held_lock`), held from
    a read of the ledger to its write: another run that changes it meanwhile waits."""
    lock = state_dir() / "ledger.lock"
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(held_lock(lock))
        except OSError as exc:
            raise Sm121Error(f"could not take the ledger's lock {lock}: "
                             f"{exc.strerror or exc}") from None
        yield


def update(change: Callable[[Ledger], object]) -> None:
    """Read the ledger, `change` it and write it, under its lock: neither of two runs at
    once loses the other's records."""
    with _locked():
        ledger = load()
        change(ledger)
        save(ledger)


def record_built(image_id: str, tags: list[str], base_id: str, base_ref: str = "",
                 content_key: str = "") -> None:
    update(lambda ledger: ledger.add_built(image_id, tags, base_id, base_ref, content_key))


def record_replaced(ref: str, image_id: str) -> None:
    update(lambda ledger: ledger.add_replaced(ref, image_id))
