"""`sm121-build prune --keep N`: remove this tool's older builds and the bases it replaced."""

from __future__ import annotations

import click

from sm121_build.cli.params import Count
from sm121_build.core.console import say, shown
from sm121_build.image.engine import Engine
from sm121_build.jobs.upkeep.pruning import prune


@click.command(name="prune")
@click.option("--keep", type=Count(1, 1_000_000), default=3, show_default=True,
              help="Keep the newest N (>= 1) images this tool built on this machine.")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
def prune_command(keep: int, dry_run: bool) -> None:
    """Remove images this tool built (beyond the newest --keep) and old bases its --pull
    replaced, when nothing else tags or builds on them.  Never any other image."""
    result = prune(Engine.connect(), keep, dry_run)
    verb = "would remove" if dry_run else "removed"
    for line in result.removed:
        say(f"{verb} {shown(line)}")
    for line in result.kept:
        say(f"kept {shown(line)}")
    say(f"{verb} {len(result.removed)} image(s), kept {len(result.kept)} candidate(s)")
