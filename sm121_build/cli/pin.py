"""`sm121-build pin IMAGE`: the image's vLLM version, commit and build paths."""

from __future__ import annotations

from pathlib import Path

import click

from sm121_build.cli.params import InputPath
from sm121_build.core.console import results_to_stderr, say, say_json, shown
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.source.git_pin import UPSTREAM, fetch_source, resolve_checkout, version_to_ref


@click.command()
@click.argument("image")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--fetch", is_flag=True, help="Also fetch the source at that commit.")
@click.option("--source", type=InputPath(file_okay=False, exists=True, path_type=Path),
              help="Use this existing checkout instead of fetching.")
@click.option("--repo", default=UPSTREAM, show_default=True, help="Upstream git URL.")
def pin(image: str, as_json: bool, fetch: bool, source: Path | None, repo: str) -> None:
    """Read IMAGE's vLLM version and commit (no container is run) and map them to git."""
    if as_json:
        results_to_stderr()  # stdout holds the JSON alone (an annotation goes to stderr)
    facts, vllm = Pipeline.connect().resolve_image(image)
    ref = version_to_ref(vllm.version, vllm.commit_id)
    checkout = commit = None
    if source:
        checkout, commit = source, resolve_checkout(source)
    elif fetch:
        checkout, commit = fetch_source(ref, repo)
    data = {"image": facts.ref, "id": facts.id, "digest": facts.digest_ref,
            "platform": facts.platform, "vllm": facts.to_json()["vllm"],
            "git_ref": {"kind": ref.kind, "value": ref.value},
            "source": str(checkout) if checkout else None, "commit": commit}
    if as_json:
        say_json(data)
        return
    for key, value in (
            ("image", f"{facts.ref}  ({facts.platform})"), ("digest", facts.digest_ref),
            ("vllm", f"{vllm.version}  commit_id={vllm.commit_id or '-'}"),
            ("git ref", str(ref)), ("python", f"{vllm.python}  {vllm.site_packages}"),
            ("extensions", ", ".join(vllm.extensions) or "-"),
            ("cuda", f"include={vllm.cuda_include or '-'}  lib={vllm.cuda_lib or '-'}  "
                     f"home={vllm.cuda_home or '-'}"),
            ("tools", vllm.tools.describe() if vllm.tools else ""),
            ("source", f"{checkout} @ {commit}" if checkout else "")):
        if value:
            say(f"{key:<10} {shown(value)}")
