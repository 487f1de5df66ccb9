"""What this tool made on this machine: the images it built and tagged, and the bases its
`--pull` replaced.  `sm121-build prune` removes only what is written here (and still carries
the tool's labels), so it never touches an image the user made or pulled by hand.

Kept as JSON under the cache dir (`$XDG_CACHE_HOME/sm121-build/ledger.json`), written
atomically.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sm121_build.image.facts import cache_dir, store_cache

FORMAT = 1


@dataclass
class Built:
    image_id: str
    tags: list[str]
    base_id: str
    at: float


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

    def add_built(self, image_id: str, tags: list[str], base_id: str) -> None:
        for entry in self.built:
            if entry.image_id == image_id:
                entry.tags = sorted(set(entry.tags) | set(tags))
                entry.at = time.time()
                return
        self.built.append(Built(image_id, sorted(set(tags)), base_id, time.time()))

    def add_replaced(self, ref: str, image_id: str) -> None:
        if all(r.image_id != image_id for r in self.replaced):
            self.replaced.append(Replaced(ref, image_id, time.time()))


def _path() -> Path:
    return cache_dir() / "ledger.json"


def load() -> Ledger:
    try:
        raw = json.loads(_path().read_text())
        return Ledger([Built(**b) for b in raw.get("built", [])],
                      [Replaced(**r) for r in raw.get("replaced", [])])
    except (OSError, ValueError, TypeError, AttributeError):
        return Ledger()


def save(ledger: Ledger) -> None:
    store_cache(_path(), json.dumps({"format": FORMAT, **asdict(ledger)}, indent=2))


def record_built(image_id: str, tags: list[str], base_id: str) -> None:
    ledger = load()
    ledger.add_built(image_id, tags, base_id)
    save(ledger)


def record_replaced(ref: str, image_id: str) -> None:
    ledger = load()
    ledger.add_replaced(ref, image_id)
    save(ledger)
