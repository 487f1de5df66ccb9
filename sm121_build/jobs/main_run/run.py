"""The main job's one owner: a request in, a result out.  The command line parses and checks
the options and prints nothing of its own; which path a run takes lives here, as a list of
actions (`ACTIONS`), each of which says when it applies and what it does:

1. **look up** (`--kernels-from`): a verified kernels image of this base's vLLM build;
2. **inject** it on a hit (no compile);
3. **build** on a miss, unless `--no-build`: `main_job.run_build`, whose plan gives each
   extension its own action (`aot` from the stock file's PTX, `build` from the source, or
   `keep`);
4. **publish** (`--kernels-to`) what was verified, signed when a key is given.

A new path is one more `Action` here, placed in `ACTIONS`: the actions before it leave what
they found in the `Run`, the ones after read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Protocol

from sm121_build.core.console import note
from sm121_build.core.errors import Sm121Error
from sm121_build.jobs.formats.artifacts import Artifacts
from sm121_build.jobs.framework.pipeline import Keys, Pipeline
from sm121_build.jobs.framework.run_record import PUBLISHABLE
from sm121_build.jobs.framework.session import Reporting, Serving, run_session
from sm121_build.jobs.kernel_images.injection import Destination, run_inject
from sm121_build.jobs.kernel_images.kernels_image import Wanted, look_up, publish_step
from sm121_build.jobs.main_run.main_job import run_build
from sm121_build.jobs.main_run.main_plan import Options


@dataclass(frozen=True)
class Kernels:
    """Kernels images around the run: where to look first, where to publish after, whether
    a miss fails the run, and the keys (the one that signs what is published, the one a hit
    must be signed by), which the run's pipeline is given."""

    from_repo: str | None = None
    to_repo: str | None = None
    no_build: bool = False
    keys: Keys = field(default_factory=Keys)


@dataclass(frozen=True)
class RunRequest:
    """Everything a run of the main job is asked (checked by the command line)."""

    options: Options
    kernels: Kernels = field(default_factory=Kernels)
    reporting: Reporting = field(default_factory=Reporting)


@dataclass(frozen=True)
class RunResult:
    """What a run did: the tag it made or kept, the actions it took, what it pushed."""

    tag: str
    path: str  # "kernels-hit", "build" or "planned": how the run got its image (or none)
    pushed: tuple[str, ...] = ()
    actions: tuple[str, ...] = ()  # the names of the actions taken, in order


@dataclass
class Run:
    """One run as its actions see it: what was asked, and what the actions so far found."""

    pipeline: Pipeline
    opts: Options
    kernels: Kernels
    tmp: Path  # the run's temporary folder, removed when it ends
    found: Artifacts | None = None  # a verified kernels image of this base (look up)
    tag: str | None = None  # the tag given to the result (inject or build)
    path: str = ""
    pushed: tuple[str, ...] = ()
    taken: list[str] = field(default_factory=list)


class Action(Protocol):
    """One step of the path a run takes."""

    name: ClassVar[str]

    def applies(self, run: Run) -> bool: ...

    def __call__(self, run: Run) -> None: ...


class LookUp:
    """`--kernels-from`: a verified, trusted kernels image of this base's build, or a miss
    (said); a miss with `--no-build` ends the run."""

    name: ClassVar[str] = "look up"

    def applies(self, run: Run) -> bool:
        return bool(run.kernels.from_repo) and not run.opts.plan_only

    def __call__(self, run: Run) -> None:
        repo, opts = run.kernels.from_repo or "", run.opts
        run.found = look_up(run.pipeline, repo,
                            Wanted(opts.base, opts.arch, opts.pull, opts.gpu),
                            run.tmp / "kernels")
        if run.found is None and run.kernels.no_build:
            used = run.pipeline.record.kernels_from
            raise Sm121Error(f"no kernels image for {opts.base} in {repo} "
                             f"({used.why if used else ''}; --no-build): publish one with "
                             "`sm121-build kernels publish`, or drop --no-build to compile")
        run.opts = replace(opts, pull="never")  # pulled for the lookup already


class InjectHit:
    """A hit goes into the pristine base, verified as a build would be; nothing compiles."""

    name: ClassVar[str] = "inject"

    def applies(self, run: Run) -> bool:
        return run.found is not None

    def __call__(self, run: Run) -> None:
        assert run.found is not None
        opts = run.opts
        run.tag = run_inject(run.pipeline, run.found, opts.base,
                             Destination(opts.tag, opts.out, opts.replace_tag))
        run.path = "kernels-hit"


class Build:
    """No hit: the main job, whose plan gives each extension aot, build or keep (`--plan`:
    the plan alone)."""

    name: ClassVar[str] = "build"

    def applies(self, run: Run) -> bool:
        return run.tag is None

    def __call__(self, run: Run) -> None:
        run.tag = run_build(run.pipeline, run.opts)
        run.path = "planned" if run.opts.plan_only else "build"


class Publish:
    """`--kernels-to`: what this run verified (a build's files, or a hit from another
    repository), pushed as a kernels image; a run that built nothing says so."""

    name: ClassVar[str] = "publish"

    def applies(self, run: Run) -> bool:
        return bool(run.kernels.to_repo) and not run.opts.plan_only

    def __call__(self, run: Run) -> None:
        to_repo, opts = run.kernels.to_repo or "", run.opts
        if run.found is not None:
            if to_repo != run.kernels.from_repo:
                run.pushed = tuple(publish_step(run.pipeline, opts.out or run.found.folder,
                                                to_repo, opts.base, opts.replace_tag))
        elif opts.out and run.pipeline.record.status in PUBLISHABLE:
            run.pushed = tuple(publish_step(run.pipeline, opts.out, to_repo, opts.base,
                                            opts.replace_tag))
        else:
            note(f"--kernels-to {to_repo}: nothing was built, nothing to publish")


# the path of every run, in order: each action that applies runs
ACTIONS: tuple[Action, ...] = (LookUp(), InjectHit(), Build(), Publish())


def run_main(request: RunRequest) -> RunResult:
    """The main job, whole: the session, then every action that applies, in order."""
    opts, kernels = request.options, request.kernels
    serving = Serving(opts.arch, opts.gpu, kernels.keys)
    with run_session("build", opts.base, opts.tag, serving, request.reporting) as (pipeline, tmp):
        # --kernels-to without --out exports to a temporary folder the record does not name
        export = opts.out or (tmp / "kernels-to" if kernels.to_repo else None)
        run = Run(pipeline, replace(opts, out=export), kernels, tmp)
        for action in ACTIONS:
            if action.applies(run):
                action(run)
                run.taken.append(action.name)
        if opts.out is None:
            pipeline.record.exported(None)
        return RunResult(run.tag or opts.tag, run.path, run.pushed, tuple(run.taken))
