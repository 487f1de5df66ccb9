"""docs/security.md's matrix (every door × every surface, issue 62) stays true: every test
a cell names exists, and every command of the CLI has a row, so the next surface gets one
the day it is added."""

from __future__ import annotations

import re
from pathlib import Path

import click

from sm121_build.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"
CELL_TEST = re.compile(r"\b((?:integration/)?test_\w+)::(test_\w+)")


def _matrix() -> str:
    text = DOC.read_text()
    start = text.index("## The matrix: every door × every surface")
    return text[start:text.index("\n## ", start + 1)]


def test_every_test_a_cell_names_exists() -> None:
    named = set(CELL_TEST.findall(_matrix()))
    assert len(named) > 50
    missing = []
    for module, function in sorted(named):
        path = ROOT / "tests" / ("" if module.startswith("integration/") else "unit") / \
            f"{module}.py"
        if not path.is_file() or not re.search(rf"^def {function}\(", path.read_text(),
                                               re.MULTILINE):
            missing.append(f"{module}::{function}")
    assert missing == []


def _commands(group: click.Group, prefix: str = "") -> list[str]:
    found = []
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            found += _commands(command, f"{prefix}{name} ")
        else:
            found.append(f"{prefix}{name}")
    return found


def test_every_command_has_a_row() -> None:
    rows = {line.split("|")[1].strip() for line in _matrix().splitlines()
            if line.startswith("| ")}
    shown = " ".join(rows)
    lacking = [name for name in _commands(cli) if name != "build" and f"`{name}" not in shown]
    assert lacking == []
