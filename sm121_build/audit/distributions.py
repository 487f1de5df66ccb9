"""Which installed distribution owns an audited file: the `.dist-info` whose RECORD lists it.

NVIDIA's CUDA wheels all install under one `nvidia/` folder (`nvidia/cu13/lib/...`), so the
folder a file sits in says "nvidia" for cuBLAS, cuDNN, NCCL and cuSPARSELt alike; the RECORD
of each distribution names its own files.  A wheel's members belong to the distribution its
file name gives (`cuda/wheel.wheel_name`).
"""

from __future__ import annotations

import csv
import io
import posixpath
import re
from dataclasses import dataclass, field

from sm121_build.cuda.wheel import record_owner

# What is audited in a folder, archive or image: shared objects, and device code as files
# of its own (FlashInfer's cubin packages ship thousands of raw `.cubin` files); only the
# RECORD rows that name such a file are kept, the only ones an owner is asked of
SHARED_OBJECT = re.compile(r"\.(so(\.\d+)*|cubin|fatbin|ptx)$")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 normalises it (`nvidia_cublas` -> `nvidia-cublas`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Owners:
    """Installed file path (as the audit names it) -> the distribution whose RECORD lists it.

    Two distributions whose RECORDs list one path (two wheels installed onto one file, as
    pip allows) are both kept (`claims`): the file is counted under the first of them by
    name, whichever RECORD was read first, and the caller says so."""

    by_path: dict[str, str] = field(default_factory=dict)
    contested: dict[str, set[str]] = field(default_factory=dict)  # listed by 2+ distributions
    unreadable: list[str] = field(default_factory=list)

    def add_record(self, record_path: str, raw: bytes) -> None:
        """A RECORD's rows that name a file audit reads (`SHARED_OBJECT`): paths relative to
        the folder that holds the `.dist-info`.  Its text is decoded and parsed a window at
        a time, never held whole as rows (a 60 MB RECORD of short rows is millions of
        lists).  One that is not CSV text is noted (its files fall back to their folder's
        name) and none of its rows is kept."""
        named = record_owner(record_path)
        if named is None:
            return
        owner = canonical(named)
        site = posixpath.dirname(posixpath.dirname(record_path))
        kept: set[str] = set()
        text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", newline="\n")
        try:
            for row in csv.reader(text):
                if row and row[0]:
                    path = posixpath.normpath(posixpath.join(site, row[0]))
                    if SHARED_OBJECT.search(path):
                        kept.add(path)
        except (UnicodeDecodeError, csv.Error) as exc:
            self.unreadable.append(f"{record_path}: {exc}")
            return
        for path in kept:
            held = self.by_path.setdefault(path, owner)
            if held != owner:
                self.contested.setdefault(path, {held}).add(owner)
                self.by_path[path] = min(held, owner)

    def owner(self, name: str) -> str | None:
        """The distribution `name` is counted under: the one RECORD's that lists it, the
        first by name of several."""
        return self.by_path.get(posixpath.normpath(name))

    def claims(self, name: str) -> tuple[str, ...]:
        """Every distribution whose RECORD lists `name`, by name (none, one, or more)."""
        path = posixpath.normpath(name)
        if path in self.contested:
            return tuple(sorted(self.contested[path]))
        owner = self.by_path.get(path)
        return (owner,) if owner is not None else ()
