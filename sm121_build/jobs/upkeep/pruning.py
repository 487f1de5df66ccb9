"""Free a build runner's disk: remove what this tool made, beyond the newest N builds.

Only images in the ledger (built, injected or replaced by this tool on this machine) are
candidates; a built one must still carry the tool's labels, and an image that also has a tag
the tool did not give it is left alone.  Nothing is removed by force, and nothing is untagged
unless it can then be removed: an image something else builds on or a container uses stays
exactly as it was, tags included.  The BuildKit cache (ccache mount) is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from sm121_build.core.errors import Sm121Error
from sm121_build.core.labels import made_by_us
from sm121_build.image import ledger as ledger_mod
from sm121_build.image.api import ImageEngine


@dataclass
class Pruned:
    removed: list[str] = field(default_factory=list)  # "ID (tags)" lines
    kept: list[str] = field(default_factory=list)  # "ID: why" lines


def _short(image_id: str) -> str:
    return image_id.split(":")[-1][:12]


def prune(engine: ImageEngine, keep: int, dry_run: bool = False) -> Pruned:
    if keep < 1:
        raise Sm121Error(f"--keep {keep}: keep at least the newest build (1 or more)")
    book = ledger_mod.load()
    result = Pruned()
    alive = [b for b in book.built if engine.image_id(b.image_id)]
    ours = [b for b in alive if made_by_us(engine.image(b.image_id).labels)]
    ours.sort(key=lambda b: b.at, reverse=True)
    gone: set[str] = {b.image_id for b in book.built} - {b.image_id for b in alive}

    def remove(image_id: str, removed: str, kept_as: str, tags: tuple[str, ...] = ()) -> None:
        """Untag `tags` and remove the image unless dry-run; one result line either way.
        What is in use is left with its tags; a removal the engine still refuses gets its
        tags back."""
        busy = engine.in_use(image_id)
        if busy:
            result.kept.append(f"{kept_as}: {busy}")
            return
        if dry_run:
            result.removed.append(removed)
            return
        for tag in tags:
            engine.untag(tag)
        why = engine.remove_unused(image_id)
        if why:
            for tag in tags:
                engine.tag(image_id, tag)
            result.kept.append(f"{kept_as}: {why}")
        else:
            result.removed.append(removed)
            gone.add(image_id)

    for entry in ours[keep:]:
        tags = engine.tags_of(entry.image_id)
        foreign = [t for t in tags if t not in entry.tags]
        if foreign:
            result.kept.append(f"{_short(entry.image_id)}: also tagged {', '.join(foreign)} "
                               "(not by sm121-build)")
            continue
        remove(entry.image_id, f"{_short(entry.image_id)} ({', '.join(tags) or 'untagged'})",
               _short(entry.image_id), tags)
    for old in book.replaced:
        if not engine.image_id(old.image_id):
            gone.add(old.image_id)
            continue
        tags = engine.tags_of(old.image_id)
        if tags:
            result.kept.append(f"{_short(old.image_id)} (old {old.ref}): tagged {', '.join(tags)}")
            continue
        remove(old.image_id, f"{_short(old.image_id)} (old {old.ref}, untagged)",
               f"{_short(old.image_id)} (old {old.ref})")
    if not dry_run and gone:  # the ledger as it is now: a run may have recorded meanwhile
        ledger_mod.update(partial(_forget, gone))
    return result


def _forget(gone: set[str], book: ledger_mod.Ledger) -> None:
    book.built = [b for b in book.built if b.image_id not in gone]
    book.replaced = [r for r in book.replaced if r.image_id not in gone]
