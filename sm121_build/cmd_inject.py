"""`sm121-build inject --artifacts DIR --base IMAGE`: prebuilt kernels in seconds."""

from __future__ import annotations

from pathlib import Path

import click

from .inject import run_inject
from .refs import default_tag, validate_image_ref


@click.command()
@click.option("--artifacts", "folder", required=True,
              type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Folder written by `sm121-build --base IMAGE --out DIR`.")
@click.option("--base", required=True, help="Stock vLLM image of the same version and commit.")
@click.option("--tag", help="Tag for the result (default: the base tag with -sm121).")
def inject(folder: Path, base: str, tag: str | None) -> None:
    """Copy prebuilt .so files into BASE (no compile), verify, tag.

    Refuses artifacts built for another vLLM version or commit.
    """
    validate_image_ref(base)
    run_inject(folder, base, validate_image_ref(tag) if tag else default_tag(base))
