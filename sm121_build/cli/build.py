"""`sm121-build --base IMAGE` (= `sm121-build build --base IMAGE`): the main job."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from sm121_build.cli.params import (
    InputPath,
    arch_for_gpu,
    extension_names,
    extension_option,
    gpu_option,
    jobs_option,
    optional_arch_list,
    require_outputs,
    sign_key_option,
    signing_key,
    trust_key_option,
)
from sm121_build.core.errors import Sm121Error
from sm121_build.core.vllm import extension_target
from sm121_build.cuda.binary import Policy
from sm121_build.cuda.compat import (
    DEFAULT_ARCH,
    DEFAULT_DRIVER_CUDA,
    DEFAULT_GPU,
    ArchList,
    parse_cuda_version,
)
from sm121_build.image.cosign import TrustKey
from sm121_build.image.refs import (
    IMAGE_ID,
    default_tag,
    require_not_base,
    validate_image_ref,
    validate_tag,
)
from sm121_build.jobs.framework.pipeline import Keys
from sm121_build.jobs.framework.session import Reporting
from sm121_build.jobs.kernel_images.kernels_image import require_repository
from sm121_build.jobs.main_run.main_plan import Options, source_build_refused
from sm121_build.jobs.main_run.run import Kernels, RunRequest, run_main
from sm121_build.source.external import projects_for, require_project_tree
from sm121_build.source.git_pin import UPSTREAM, require_vllm_tree

REPORT_HELP = "Write what the run did (status, provenance, audit before/after) as JSON."
SUMMARY_HELP = "Append that report as Markdown (e.g. \"$GITHUB_STEP_SUMMARY\")."
REPLACE_TAG_HELP = ("Let --tag move off an image sm121-build did not build from this base "
                    "(that image stays; the base's own tag never moves).")


@click.command()
@click.option("--base", help="Stock vLLM image in the local engine.")
@click.option("--tag", help="Tag for the result (default: the base tag with -sm121, or the "
                            "--gpu's suffix: -sm120, ...).")
@gpu_option()
@click.option("--driver", default=DEFAULT_DRIVER_CUDA, show_default=True,
              help="The oldest CUDA driver the result must serve: PTX newer than it reads is "
                   "judged unloadable (not JIT-able) in the plan and in verification.")
@click.option("--arch", callback=optional_arch_list,
              help=f"TORCH_CUDA_ARCH_LIST of a source build ({DEFAULT_GPU}); {DEFAULT_ARCH}a "
                   "keeps NVFP4 kernels "
                   f"where the source allows.  [default: {DEFAULT_ARCH}]")
@extension_option("Also rebuild this extension (e.g. _moe_C_stable_libtorch), whatever the "
                  "decision says; `auto` is accepted (the default run already builds every "
                  "extension that gains).")
@click.option("--only", multiple=True, callback=extension_names,
              help="Build no extension but these (repeatable; a CMake target or file name).")
@click.option("--plan", "plan_only", is_flag=True,
              help="Decide and print the plan (per extension: build or keep, and why); build "
                   "nothing.")
@jobs_option()
@click.option("--source", type=InputPath(file_okay=False, exists=True, path_type=Path),
              help="Existing vLLM checkout at the image's commit (else fetched).")
@click.option("--repo", default=UPSTREAM, show_default=True, envvar="SM121_BUILD_REPO",
              help="Upstream git URL or path (a mirror; env SM121_BUILD_REPO).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Export the built .so files and manifest.json here.")
@click.option("--force", is_flag=True, help="Rebuild even when the content key is unchanged.")
@click.option("--from-source", is_flag=True,
              help="Build every extension that gains from the source, as before aot: no "
                   "extension is made native from its stock PTX (`aot`) instead.")
@click.option("--pull", type=click.Choice(["always", "missing", "never"]), is_flag=False,
              flag_value="always", default="never", show_default=True,
              help="Pull the base first: --pull (always, like `docker build --pull`, for a "
                   "moving tag) or --pull=missing (only when it is not here).")
@click.option("--versioned-tag", is_flag=True,
              help="Also tag <tag>-<vLLM version>-<commit>-b<base ID>: an immutable name to pin.")
@click.option("--fa-source", type=InputPath(file_okay=False, exists=True, path_type=Path),
              help="Existing flash-attention checkout at the commit vLLM pins (else fetched "
                   "from the GIT_REPOSITORY vLLM's CMake names).")
@click.option("--allow-other-commit", is_flag=True,
              help="Build a --source checkout at another commit than the image's (recorded).")
@click.option("--no-patch", is_flag=True, help="Build without the guard rules (diagnosis).")
@click.option("--replace-tag", is_flag=True, help=REPLACE_TAG_HELP)
@click.option("--kernels-from", "kernels_from", metavar="REPO",
              help="Look for a kernels image of this base's vLLM build in REPO (tag "
                   "<version>-<commit>-<cuXYZ>-<arch>): on a hit, inject and verify it, no "
                   "compile; on a miss, build as usual.")
@click.option("--kernels-to", "kernels_to", metavar="REPO",
              help="After verification, push the rebuilt files as a kernels image to REPO "
                   "(tags k-<reuse key>, <version>-<commit>-<cuXYZ>-<arch> and the base's "
                   "tag), with the engine's `docker login`.")
@sign_key_option("With --kernels-to: sign the pushed kernels image with this ECDSA P-256 "
                   "PEM key, in cosign's format (`cosign verify --key` reads it); with --out: "
                   "sign the folder's manifest.json (manifest.json.sig, as `cosign sign-blob` "
                   "makes it), which `inject --artifacts DIR --trust-key` requires; a "
                   "passphrase from COSIGN_PASSWORD.")
@trust_key_option("With --kernels-from: use a hit only when this public key (cosign.pub) "
                  "signed it; an unsigned or wrongly signed one is refused and the run "
                  "builds.")
@click.option("--no-build", is_flag=True,
              help="With --kernels-from: fail on a miss instead of building.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help=REPORT_HELP)
@click.option("--json", "as_json", is_flag=True,
              help="The run's record (the --report schema) on stdout, however it ends; the "
                   "result lines go to stderr.")
@click.option("--summary-md", type=click.Path(dir_okay=False, path_type=Path),
              help=SUMMARY_HELP)
def build(  # noqa: PLR0913 (a click command: a parameter per option)
          base: str | None, tag: str | None, gpu: Policy, driver: str,
          arch: ArchList | None,
          extra_ext: tuple[str, ...],
          jobs: int | None, source: Path | None, repo: str, out: Path | None, force: bool,
          no_patch: bool, report: Path | None, summary_md: Path | None,
          pull: str, versioned_tag: bool,
          allow_other_commit: bool, fa_source: Path | None, only: tuple[str, ...],
          plan_only: bool, replace_tag: bool, as_json: bool, kernels_from: str | None,
          kernels_to: str | None, no_build: bool, from_source: bool, sign_key: Path | None,
          trust_key: Path | None) -> None:
    """Build every extension of BASE that gains native sm_121 code and inject them into an
    untouched copy."""
    if not base:
        raise click.UsageError("name the stock image: --base IMAGE (or `sm121-build local "
                               "--source DIR --out DIR` to build on this machine)")
    validate_image_ref(base)
    if no_build and not kernels_from:
        raise click.UsageError("--no-build goes with --kernels-from REPO")
    if sign_key and not (kernels_to or out):
        raise click.UsageError("--sign-key goes with --kernels-to REPO or --out DIR")
    signing = signing_key(sign_key) if sign_key else None
    # read (through the files-in door) whenever it is given, used with --kernels-from: a
    # FIFO or a damaged key is refused before any work, not passed over in silence
    loaded = TrustKey.load(trust_key) if trust_key else None
    trusted = loaded if kernels_from else None
    for option, repository in (("--kernels-from", kernels_from), ("--kernels-to", kernels_to)):
        if repository:
            require_repository(repository, option)
    if source:
        require_vllm_tree(source)  # before the engine, the pull and a 1 GB copy
    if fa_source:
        require_project_tree(fa_source, "vllm-flash-attn")
    # an extension no rule can build for sm_12x (flash-attention 3): refused before any work
    projects_for([extension_target(e) for e in extra_ext if e != "auto"], None)
    if pull != "never" and IMAGE_ID.match(base):
        raise Sm121Error(f"--pull needs a repository reference, not the image ID {base}")
    result_tag = validate_tag(tag) if tag else default_tag(base, gpu.suffix)
    require_not_base(result_tag, base)
    require_outputs(out, report, summary_md, (source, fa_source, sign_key, trust_key))
    arch = arch_for_gpu(arch, gpu)
    gpu = replace(gpu, driver=parse_cuda_version(driver))
    if not gpu.has_source_rules and (source or from_source or force or no_patch):
        raise Sm121Error(source_build_refused(gpu))
    options = Options(base=base, tag=result_tag, arch=arch, extra_ext=extra_ext, jobs=jobs,
                      source=source, repo=repo, out=out, force=force, no_patch=no_patch,
                      pull=pull, versioned_tag=versioned_tag,
                      allow_other_commit=allow_other_commit, fa_source=fa_source,
                      only=tuple(o for o in only if o != "auto"), plan_only=plan_only,
                      replace_tag=replace_tag, from_source=from_source, gpu=gpu)
    kernels = Kernels(kernels_from, kernels_to, no_build, Keys(signing, trusted))
    run_main(RunRequest(options, kernels, Reporting(report, summary_md, as_json)))
