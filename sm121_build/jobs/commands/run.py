"""The main job's one owner: a request in, a result out.  The command line parses and checks
the options and prints nothing of its own; which path a run takes lives here, as actions in
order:

1. **look up** (`--kernels-from`): a verified kernels image of this base's vLLM build;
2. **inject** it on a hit (no compile), or **build** (`main_job.run_build`: per extension
   `aot`, `build` or `keep`) on a miss, unless `--no-build`;
3. **publish** (`--kernels-to`) what was verified, signed when a key is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from sm121_build.core.console import note
from sm121_build.core.errors import Sm121Error
from sm121_build.image.cosign import SigningKey, TrustKey
from sm121_build.jobs.commands.inject import Destination, run_inject
from sm121_build.jobs.commands.kernels_image import look_up, publish_step
from sm121_build.jobs.commands.main_job import Options, run_build
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.jobs.framework.session import Reporting, run_session
from sm121_build.verify.run_report import PUBLISHABLE


@dataclass(frozen=True)
class Kernels:
    """Kernels images around the run: where to look first, where to publish after, whether
    a miss fails the run, the key that signs what is published and the key a hit must be
    signed by."""

    from_repo: str | None = None
    to_repo: str | None = None
    no_build: bool = False
    sign_key: SigningKey | None = None
    trust_key: TrustKey | None = None


@dataclass(frozen=True)
class RunRequest:
    """Everything a run of the main job is asked (checked by the command line)."""

    options: Options
    kernels: Kernels = field(default_factory=Kernels)
    reporting: Reporting = field(default_factory=Reporting)


@dataclass(frozen=True)
class RunResult:
    """What a run did: the tag it made or kept, the path it took, what it pushed."""

    tag: str
    path: str  # "kernels-hit", "build" or "planned"
    pushed: tuple[str, ...] = ()


def run_main(request: RunRequest) -> RunResult:
    """The main job, whole: the session, the lookup, the build or the injection, the
    publication."""
    opts, kernels = request.options, request.kernels
    with run_session("build", opts.base, opts.tag, opts.arch, request.reporting) as (
            pipeline, tmp):
        pipeline.sign_key, pipeline.trust_key = kernels.sign_key, kernels.trust_key
        # --kernels-to without --out exports to a temporary folder the record does not name
        export = opts.out or (tmp / "kernels-to" if kernels.to_repo else None)
        result = _run(pipeline, replace(opts, out=export), kernels, tmp)
        if opts.out is None:
            pipeline.record.exported(None)
        return result


def _run(pipeline: Pipeline, opts: Options, kernels: Kernels, tmp: Path) -> RunResult:
    if kernels.from_repo and not opts.plan_only:
        found = look_up(pipeline, kernels.from_repo, opts.base, opts.arch, opts.pull,
                        tmp / "kernels")
        if found is not None:
            tag = run_inject(pipeline, found, opts.base,
                             Destination(opts.tag, opts.out, opts.replace_tag))
            pushed: tuple[str, ...] = ()
            if kernels.to_repo and kernels.to_repo != kernels.from_repo:
                pushed = tuple(publish_step(pipeline, opts.out or found.folder,
                                            kernels.to_repo, opts.base))
            return RunResult(tag, "kernels-hit", pushed)
        if kernels.no_build:
            why = pipeline.record.kernels_from.why if pipeline.record.kernels_from else ""
            raise Sm121Error(f"no kernels image for {opts.base} in {kernels.from_repo} ({why}; "
                             "--no-build): publish one with `sm121-build kernels publish`, or "
                             "drop --no-build to compile")
        opts = replace(opts, pull="never")  # pulled for the lookup already
    tag = run_build(pipeline, opts)
    if kernels.to_repo and opts.out and pipeline.record.status in PUBLISHABLE:
        pushed = tuple(publish_step(pipeline, opts.out, kernels.to_repo, opts.base))
        return RunResult(tag, "build", pushed)
    if kernels.to_repo and not opts.plan_only:
        note(f"--kernels-to {kernels.to_repo}: nothing was built, nothing to publish")
    return RunResult(tag, "planned" if opts.plan_only else "build")
