"""Which installed distribution owns an audited file: the `.dist-info` whose RECORD lists it.

NVIDIA's CUDA wheels all install under one `nvidia/` folder (`nvidia/cu13/lib/...`), so the
folder a file sits in says "nvidia" for cuBLAS, cuDNN, NCCL and cuSPARSELt alike; the RECORD
of each distribution names its own files.  A wheel's members belong to the distribution its
file name gives.
"""

from __future__ import annotations

import csv
import io
import posixpath
import re
from dataclasses import dataclass, field

MAX_RECORD = 64 << 20  # torch's RECORD is ~2 MB
_DIST_INFO = re.compile(r"(?:^|/)([^/]+?)-[^/-]+\.dist-info/RECORD\Z")
_WHEEL_NAME = re.compile(r"\A([^-/]+)-[^-/]+(-[^-/]+)?-[^-/]+-[^-/]+-[^-/]+\.whl\Z")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 normalises it (`nvidia_cublas` -> `nvidia-cublas`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_record(path: str) -> bool:
    """A `NAME-VERSION.dist-info/RECORD` file."""
    return _DIST_INFO.search(path) is not None


def wheel_distribution(filename: str) -> str | None:
    """The distribution a wheel file installs, from its name (PEP 427), None if not one."""
    found = _WHEEL_NAME.match(posixpath.basename(filename))
    return canonical(found.group(1)) if found else None


@dataclass
class Owners:
    """Installed file path (as the audit names it) -> the distribution whose RECORD lists it."""

    by_path: dict[str, str] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)

    def add_record(self, record_path: str, raw: bytes) -> None:
        """A RECORD's rows: paths relative to the folder that holds the `.dist-info`.  One
        that is not CSV text is noted (its files fall back to their folder's name)."""
        found = _DIST_INFO.search(record_path)
        if found is None:
            return
        owner = canonical(found.group(1))
        site = posixpath.dirname(posixpath.dirname(record_path))
        try:
            rows = list(csv.reader(io.StringIO(raw.decode("utf-8"))))
        except (UnicodeDecodeError, csv.Error) as exc:
            self.unreadable.append(f"{record_path}: {exc}")
            return
        for row in rows:
            if row and row[0]:
                self.by_path[posixpath.normpath(posixpath.join(site, row[0]))] = owner

    def owner(self, name: str) -> str | None:
        return self.by_path.get(posixpath.normpath(name))
