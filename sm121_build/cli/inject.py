"""`sm121-build inject --artifacts DIR --base IMAGE`: prebuilt kernels in seconds."""

from __future__ import annotations

from pathlib import Path

import click

from sm121_build.cli.build import REPLACE_TAG_HELP, REPORT_HELP, SUMMARY_HELP
from sm121_build.cli.params import InputPath, gpu_option, require_outputs, trust_key_option
from sm121_build.core.console import results_to_stderr
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.binary import Policy
from sm121_build.image.cosign import TrustKey
from sm121_build.image.refs import (
    default_tag,
    require_not_base,
    validate_image_ref,
    validate_tag,
)
from sm121_build.jobs.formats.artifacts import load
from sm121_build.jobs.framework.pipeline import Keys
from sm121_build.jobs.framework.session import Reporting, Serving, run_session
from sm121_build.jobs.kernel_images.injection import Destination, run_inject
from sm121_build.jobs.kernel_images.kernels_image import fetch_step, gpu_refusal


@click.command()
@click.option("--artifacts", "folder",
              type=InputPath(file_okay=False, exists=True, path_type=Path),
              help="Folder written by `sm121-build --base IMAGE --out DIR`.")
@click.option("--from", "kernels_ref", metavar="REF",
              help="A kernels image instead (`sm121-build kernels publish`), pulled with the "
                   "engine's login: e.g. REPO:k-<reuse key> or "
                   "REPO:<version>-<commit>-<cuXYZ>-<arch>.")
@click.option("--base", required=True, help="Stock vLLM image of the same version and commit.")
@click.option("--tag", help="Tag for the result (default: the base tag with -sm121, or the "
                            "--gpu's suffix).")
@gpu_option()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Export the injected .so files and manifest.json here too.")
@click.option("--replace-tag", is_flag=True, help=REPLACE_TAG_HELP)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help=REPORT_HELP)
@click.option("--summary-md", type=click.Path(dir_okay=False, path_type=Path),
              help=SUMMARY_HELP)
@click.option("--json", "as_json", is_flag=True,
              help="The run's record (the --report schema) on stdout, however it ends.")
@trust_key_option("Refuse the kernels (exit 3) unless this public key (cosign.pub) signed "
                  "them: the kernels image of --from, or the manifest.json of --artifacts "
                  "(manifest.json.sig, written by `--out DIR --sign-key KEY`).")
def inject(  # noqa: PLR0913 (a click command: a parameter per option)
           folder: Path | None, kernels_ref: str | None, base: str, tag: str | None,
           gpu: Policy, out: Path | None, report: Path | None, summary_md: Path | None,
           replace_tag: bool, as_json: bool, trust_key: Path | None) -> None:
    """Copy prebuilt .so files into BASE (no compile), verify, tag.

    Refuses artifacts built for another vLLM version or commit, or made for another GPU
    than --gpu.
    """
    if as_json:
        results_to_stderr()  # stdout holds the JSON alone (an annotation goes to stderr)
    if (folder is None) == (kernels_ref is None):
        raise click.UsageError("name the kernels: --artifacts DIR or --from REF (one of them)")
    validate_image_ref(base)
    if kernels_ref is not None:
        validate_image_ref(kernels_ref)
    result_tag = validate_tag(tag) if tag else default_tag(base, gpu.suffix)
    require_not_base(result_tag, base)
    require_outputs(out, report, summary_md, (folder, trust_key))
    trusted = TrustKey.load(trust_key) if trust_key else None
    # the manifest (signed by the trusted key, with one) and every file checked before the
    # engine is asked
    found = load(folder, trusted) if folder is not None else None
    why = gpu_refusal(found.provenance, gpu) if found is not None else None
    if why:  # made for another GPU: said before the engine is asked
        raise Sm121Error(f"artifacts in {folder} {why.what}: refusing to inject{why.hint}")
    with run_session("inject", base, result_tag, Serving(None, gpu, Keys(trust=trusted)),
                     Reporting(report, summary_md, as_json)) as (pipeline, tmp):
        if kernels_ref is not None:
            with pipeline.steps.step(f"kernels {kernels_ref}"):
                found = fetch_step(pipeline, kernels_ref, tmp / "artifacts").artifacts
        assert found is not None
        run_inject(pipeline, found, base, Destination(result_tag, out, replace_tag))
