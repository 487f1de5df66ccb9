"""`sm121-build kernels publish`: verified artifacts as a kernels image in a registry."""

from __future__ import annotations

import os
from pathlib import Path

import click

from sm121_build.image.cosign import SigningKey
from sm121_build.jobs.artifacts import load
from sm121_build.jobs.kernels_image import publish, require_repository
from sm121_build.jobs.pipeline import Pipeline


@click.group()
def kernels() -> None:
    """Kernels images: the rebuilt .so files of a verified run, in any container registry."""


@kernels.command("publish")
@click.option("--artifacts", "folder", required=True,
              type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Folder written by `sm121-build --base IMAGE --out DIR`.")
@click.option("--to", "repo", required=True, metavar="REPO",
              help="Repository to push to (e.g. ghcr.io/you/vllm-sm121-kernels); the "
                   "engine's `docker login` is used.")
@click.option("--tag", "extra", multiple=True, metavar="TAG",
              help="Also this tag (e.g. the base's moving tag, `nightly`); repeatable.")
@click.option("--sign-key", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Sign what was pushed with this ECDSA P-256 PEM key, in cosign's format "
                   "(a passphrase from COSIGN_PASSWORD).")
def publish_command(folder: Path, repo: str, extra: tuple[str, ...],
                    sign_key: Path | None) -> None:
    """Build the kernels image of DIR (FROM scratch: the files at their paths in the base,
    the manifest, labels) and push it as REPO:k-<reuse key>, REPO:<version>-<commit>-<arch>
    and REPO:<TAG>."""
    require_repository(repo, "--to")
    signing = SigningKey.load(sign_key, os.environ.get("COSIGN_PASSWORD")) if sign_key else None
    found = load(folder)  # every file and its sha256 before the engine is asked
    pipeline = Pipeline.connect()
    log = pipeline.new_log("kernels")
    for tag in publish(pipeline.engine, found, repo, extra, log, signing):
        click.echo(tag)
