"""Data folders shipped inside the wheel (patches/, dockerfiles/), or found in a checkout."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped_dir(name: str) -> Path:
    """The package's copy of a top-level data folder; the repository's one when not installed."""
    shipped = resources.files("sm121_build").joinpath(name)
    if shipped.is_dir():
        return Path(str(shipped))
    return Path(__file__).resolve().parent.parent / name


def package_data(name: str) -> str:
    """A data file shipped in the package (sm121_build/data/NAME)."""
    return resources.files("sm121_build").joinpath("data", name).read_text()
