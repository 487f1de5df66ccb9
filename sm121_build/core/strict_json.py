"""JSON as a signed document is read: strictly.  Python's `json.loads` takes `NaN` and
`Infinity` (no JSON number: another reader would refuse the document, or read another
value) and keeps the last of a key given twice in one object (another reader may keep the
first: two readers, two documents under one signature).  `strict_loads` refuses both, so a
proof, and a statement a registry holds, mean one thing to every reader."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

KEY_SHOWN = 80  # characters of a repeated key a message names


def strict_loads(body: bytes | str) -> object:
    """The JSON `body` holds; ValueError for what `json.loads` refuses, and for NaN,
    Infinity or a key twice in one object."""
    return json.loads(body, parse_constant=_no_constant, object_pairs_hook=_unique_keys)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = Counter(key for key, _value in pairs)
    twice = next((key for key, count in keys.items() if count > 1), None)
    if twice is not None:
        shown = twice if len(twice) <= KEY_SHOWN else f"{twice[:KEY_SHOWN]}…"
        raise ValueError(f"the key {shown!r} twice in one object")
    return dict(pairs)
