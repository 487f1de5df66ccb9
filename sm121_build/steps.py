"""Timed, titled steps on stderr; folded into groups on GitHub Actions (as cibuildwheel's
logger does), plus a live one-line status for long builds on a terminal."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import click


class Steps:
    def __init__(self) -> None:
        self.actions = os.environ.get("GITHUB_ACTIONS") == "true"

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        start = time.monotonic()
        click.echo(f"::group::{title}" if self.actions else f"==> {title}", err=True)
        try:
            yield
        finally:
            end_status_line()
            if self.actions:
                click.echo("::endgroup::", err=True)
            click.echo(f"    {title}: {time.monotonic() - start:.1f}s", err=True)


_live = {"shown": False}


def status_line(text: str) -> None:
    """Rewrite one terminal line with the latest build output (nothing when not a TTY)."""
    if sys.stderr.isatty():
        click.echo(f"\r\033[K    {text[:110]}", nl=False, err=True)
        _live["shown"] = True


def end_status_line() -> None:
    if _live["shown"]:
        click.echo("", err=True)
        _live["shown"] = False
