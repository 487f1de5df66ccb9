"""Data folders shipped inside the wheel (patches/, dockerfiles/), or found in a checkout."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any


def shipped_dir(name: str) -> Path:
    """The package's copy of a top-level data folder; the repository's one when not installed."""
    shipped = resources.files("sm121_build").joinpath(name)
    if shipped.is_dir():
        return Path(str(shipped))
    return Path(__file__).resolve().parents[2] / name


def package_data(name: str) -> str:
    """A data file shipped in the package (sm121_build/data/NAME)."""
    return resources.files("sm121_build").joinpath("data", name).read_text()


def schema(name: str) -> dict[str, Any]:
    """A JSON Schema of the tool's outputs (sm121_build/data/schemas/NAME.schema.json):
    `audit` (audit --json), `report` (--report), `manifest` (--out's manifest.json)."""
    loaded: dict[str, Any] = json.loads(package_data(f"schemas/{name}.schema.json"))
    return loaded
