"""The main job's plan: what the run does to each extension of the base (aot it, build it
from source, keep it), decided from what was read (the base's facts and its stock files'
audit, the source and its guards when they are needed), recorded and said; and the values
a run carries (`Options`, `Resolved`, `Sources`, `Job`, `ExtensionActions`).  Carrying the
plan out is `main_job.py`'s."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.console import note, result
from sm121_build.core.errors import Sm121Error
from sm121_build.core.vllm import DEFAULT_EXTENSIONS, extension_target, projects
from sm121_build.cuda.binary import DEFAULT_POLICY, BinaryReport, Policy, unreachable_words
from sm121_build.cuda.compat import DEFAULT_CUDA, DEFAULT_GPU, ArchList
from sm121_build.cuda.ptxas import Toolchain
from sm121_build.image.build_tools import (
    require_buildable,
    require_python_headers,
)
from sm121_build.image.facts import ImageFacts, VllmInstall
from sm121_build.jobs.aot_work.aot_step import (
    AotAction,
    aot_actions,
    aot_toolchain,
)
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.jobs.framework.run_record import RunDecision
from sm121_build.jobs.framework.run_warnings import ptx_warning
from sm121_build.rebuild.decide import (
    ExtensionVerdict,
    aot_does_as_well,
    decide_inputs,
    judge_extensions,
    left_by_aot,
    stock_counts,
)
from sm121_build.source.git_pin import (
    Checkout,
    GitRef,
    check_checkout,
    fetch_source,
    version_to_ref,
)
from sm121_build.source.guard_rules import (
    PatchFor,
    apply_for_build,
    rules_digest,
)
from sm121_build.source.tree import require_contained


@dataclass(frozen=True)
class Options:
    """What a run of the main job was asked, once, frozen: made by the command that parsed
    it (`build`, or `aot IMAGE` with `aot_only`), never changed after (a step that needs
    another value makes a copy, `dataclasses.replace`).  The GPU the run serves is `gpu`."""

    base: str
    tag: str
    arch: ArchList
    extra_ext: tuple[str, ...] = ()  # --ext: extensions built besides those the plan chose
    jobs: int | None = None  # --jobs: MAX_JOBS of a source build (None: from cores and memory)
    source: Path | None = None  # --source: a vLLM checkout (None: fetched at the pin)
    repo: str = ""  # --repo: the upstream git URL or path the pinned commit is fetched from
    out: Path | None = None  # --out: the artifacts folder
    force: bool = False  # --force: rebuild even when the content key is unchanged
    no_patch: bool = False  # --no-patch: build without the guard rules (diagnosis)
    pull: str = "never"  # "always" (like docker build --pull), "missing" or "never"
    versioned_tag: bool = False  # also tag <tag>-<vLLM version>-<commit>-b<base ID>
    allow_other_commit: bool = False  # build a --source at another commit than the image's
    fa_source: Path | None = None  # a local flash-attention checkout
    only: tuple[str, ...] = ()  # --only: build no other extension than these
    plan_only: bool = False  # --plan: decide, say the plan, build nothing
    replace_tag: bool = False  # --replace-tag: --tag may move off an image we did not build
    from_source: bool = False  # --from-source: build every gaining extension, no aot
    aot_only: bool = False  # `aot IMAGE`: the aot actions alone, never the source
    all_packages: bool = False  # `aot IMAGE --all-packages`: every aot-able file of the image
    gpu: Policy = DEFAULT_POLICY  # --gpu: the GPU the run serves (and the driver it is judged with)


@dataclass(frozen=True)
class BuildChoice:
    """What the decide step chose (`decide_builds`): the extensions to build, in order; the
    lines it says of each plan and aot action; the run's decision, as the record keeps it;
    the result line of a run with nothing to do (None: it has something)."""

    chosen: tuple[str, ...]
    lines: tuple[str, ...]
    decision: RunDecision
    nothing: str | None = None


def decide_builds(opts: Options, stock: Mapping[str, BinaryReport | None],
                  verdicts: Sequence[ExtensionVerdict], aot: tuple[AotAction, ...]) -> BuildChoice:
    """The decide step, a function of what was gathered alone: the stock files' audit, the
    verdicts read from the source (`judge_extensions`; none with --force) and the aot actions,
    with the options.  It reads no file and asks no engine, network or program: a build
    aot does as well is left to aot; --force builds _C/_moe_C; --ext adds, --only
    restricts."""
    names = {extension_target(n): n for n in stock}
    lines: list[str] = []
    if opts.force:
        chosen = [n for n in stock if DEFAULT_EXTENSIONS.match(n.rsplit("/", 1)[-1])]
        verdicts = []
    else:
        native = native_by_aot(aot)
        verdicts = [p for p in verdicts if not aot_does_as_well(p, native)]
        lines = [one for p in verdicts for one in (p.line(), *(f"  {why}" for why in p.remains))]
        lines += [action.line() for action in aot]
        chosen = [p.name for p in verdicts if p.build]
    for name in (e for e in opts.extra_ext if e != "auto"):
        file = names.get(extension_target(name), name)
        if file not in chosen:
            chosen.append(file)
    if opts.only:
        wanted = {extension_target(o) for o in opts.only}
        chosen = [n for n in chosen if extension_target(n) in wanted]
    built = [p for p in verdicts if p.name in chosen]
    reason = "forced (--force)" if opts.force else "; ".join(
        [f"{p.target}: {p.reason}" for p in built] + [a.line() for a in aot]) \
        or "no extension gains"
    extensions = {p.name: {**p.as_record(), "action": "build" if p.build else "keep"}
                  for p in verdicts}
    extensions.update({a.name: a.as_record(stock_counts(stock, a.name)) for a in aot})
    decision = RunDecision(bool(chosen or aot), reason, (*chosen, *(a.name for a in aot)),
                           extensions)
    if chosen or aot:
        return BuildChoice(tuple(chosen), tuple(lines), decision)
    jit = sum(p.after["jit"] for p in verdicts)
    kept = "; ".join(f"{p.target}: {p.reason}" for p in verdicts if p.before != p.after
                     or p.before["jit"] or p.before["none"])
    return BuildChoice((), tuple(lines), decision, (
        f"no rebuild needed: no extension of {opts.base} gains native {DEFAULT_GPU} code "
        f"from a rebuild ({kept or 'every kernel is already native'})"
        f"{f'; {jit} kernel(s) stay JIT-only' if jit else ''}; nothing tagged; "
        "--force builds _C/_moe_C anyway, --ext NAME builds NAME"))


def choose_to_build(job: Job, stock: dict[str, BinaryReport | None], source: Path,
                    aot: tuple[AotAction, ...] = ()) -> tuple[str, ...]:
    """Gather, decide, carry out for the source build: the verdicts read from the patched
    source (`decide.judge_extensions`: per stock extension, whether the build gives the GPU
    native code it lacks; not read with --force), the choice made of them
    (`decide_builds`), then said and recorded.  Empty: nothing to build (said, and
    recorded as not-needed)."""
    pipeline, opts = job.pipeline, job.opts
    if opts.force:
        choice = decide_builds(opts, stock, (), aot)
    else:
        with pipeline.steps.step("decide"):
            verdicts = judge_extensions(stock, decide_inputs(source, job.image.arch,
                                                         job.image.cuda, opts.gpu.target),
                                    {t: p.name for p in projects() for t in p.targets})
            choice = decide_builds(opts, stock, verdicts, aot)
            for line in choice.lines:
                note(line)
    pipeline.record.decided(choice.decision)
    if choice.nothing is not None:
        result(choice.nothing)
    return choice.chosen


def native_by_aot(aot: tuple[AotAction, ...]) -> dict[str, int]:
    """Per file aot takes, the kernels it makes native (what `rebuild/decide` weighs)."""
    return {a.name: a.able.kernels or 0 for a in aot}



@dataclass(frozen=True)
class Resolved:
    """The base and what a build of it needs to know."""

    facts: ImageFacts
    vllm: VllmInstall
    ref: GitRef  # the vLLM commit (or tag) the image was built from
    cuda: str  # the image's CUDA toolkit, X.Y
    arch: ArchList  # what to build for, in torch's and CMake's forms



@dataclass(frozen=True)
class Sources:
    """What the build compiles: vLLM at `commit` and the external projects' trees."""

    commit: str
    # the trees the content key is made of: vLLM's `commit[+changes]`, then each external
    # project's `project@commit+changes` (and, with aot, the aot key)
    provenance: tuple[str, ...]
    external: tuple[tuple[str, str], ...] = ()  # (environment variable, context folder)
    tree: Path | None = None  # vLLM's tree in the build context (None: no source build)



@dataclass(frozen=True)
class Job:
    """One run of the main job as its stages see it: the pipeline (engine, record, steps),
    the options, and the base resolved."""

    pipeline: Pipeline
    opts: Options
    image: Resolved

    @property
    def patch_for(self) -> PatchFor:
        """What the source trees are patched for: the base's vLLM, arch list and CUDA, and
        the run's GPU (`Options.gpu`, its one home)."""
        image = self.image
        return PatchFor(image.vllm.version, image.arch, image.cuda, self.opts.gpu.target)



@dataclass(frozen=True)
class ExtensionActions:
    """The run's plan, per extension: the files aot makes native from their own PTX, and the
    ones built from the source (every other extension is kept as the base has it); with the
    source they were decided on, when it was read, and the ptxas aot uses."""

    aot: tuple[AotAction, ...]
    build: tuple[str, ...]
    checkout: Checkout | None
    toolchain: Toolchain | None  # None: nothing to aot

    @property
    def prebuilt(self) -> tuple[str, ...]:
        """The files aot makes native, by their path under the package (placed, not built)."""
        return tuple(a.name for a in self.aot)

    def line(self, arch: ArchList) -> str:
        """`aot A, B; build C for 12.1`."""
        parts = ([f"aot {', '.join(a.name for a in self.aot)}"] if self.aot else []) + \
            ([f"build {', '.join(self.build)}"] if self.build else [])
        return f"{'; '.join(parts)} for {arch}"


@dataclass(frozen=True)
class NothingToDo:
    """A run that ends at the decide step: the decision to record and the line to say (None
    and "" where the step that found nothing to build recorded and said it already)."""

    decision: RunDecision | None = None
    line: str = ""


def nothing_to_aot(opts: Options, aot: tuple[AotAction, ...]) -> NothingToDo | None:
    """A run with nothing to aot and no source build to fall back on (`aot IMAGE`, or a GPU
    with no source rules), decided from the aot actions and the options alone (no I/O);
    None when the run goes on."""
    if aot or not (opts.aot_only or not opts.gpu.has_source_rules):
        return None
    return NothingToDo(RunDecision(False, "nothing to aot"),
                       f"nothing to aot: no extension of {opts.base} has JIT-only kernels with "
                       f"PTX on {opts.gpu}; nothing tagged")


def plan_actions(job: Job, context: Path) -> ExtensionActions | NothingToDo:
    """The decide step: which extensions aot makes native (none with --from-source, --force
    or --no-patch), and which a source build improves, read from the source when it is
    needed (always without aot; with aot, only when a kernel aot cannot make native remains
    and the source can be had).  `NothingToDo`: nothing gains; the carrying out records and
    says it."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    aot, stock = planned_aot(job)
    nothing = nothing_to_aot(opts, aot)
    if nothing is not None:
        return nothing
    toolchain: Toolchain | None = None
    if aot:
        toolchain = aot_toolchain()  # this machine's ptxas, before any work
        checkout = _source_if_needed(job, aot, stock, context / "src")
    else:
        require_buildable(image.vllm.tools, image.facts.ref)  # a build, before any fetch
        checkout = vllm_source(job, context / "src")
        stock = stock or stock_extensions(job)
    chosen: tuple[str, ...] = ()
    if checkout is not None:
        patch_vllm(job, context / "src")
        chosen = choose_to_build(job, stock, context / "src", aot)
    else:
        with pipeline.steps.step("decide"):
            for action in aot:
                note(action.line())
            pipeline.record.decided(aot_decision(
                opts.gpu, aot, stock,
                image.vllm.package_dir.lstrip("/") + "/" if opts.all_packages else ""))
    if not chosen and not aot:
        return NothingToDo()  # choose_to_build recorded and said why
    return ExtensionActions(aot, chosen, checkout, toolchain)


def planned_aot(job: Job) -> tuple[tuple[AotAction, ...], dict[str, BinaryReport | None]]:
    """The extensions aot makes native (none with --from-source or --force), and the stock
    audit it read for them (empty when it read none)."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    if opts.from_source or opts.force or opts.no_patch:
        return (), {}
    stock = pipeline.read_device_files(image.facts) if opts.all_packages \
        else stock_extensions(job)
    aot = aot_actions(stock, opts.gpu.target)
    if opts.only:
        wanted = {extension_target(o) for o in opts.only}
        aot = tuple(a for a in aot if extension_target(a.name) in wanted)
    return aot, stock


def aot_decision(gpu: Policy, aot: tuple[AotAction, ...],
                 stock: Mapping[str, BinaryReport | None], vllm_prefix: str = "") -> RunDecision:
    """The decision of a run without the source, made of what was gathered alone (no I/O):
    the aot actions, and every extension left with kernels aot cannot make native (kept,
    its reason in `remains`, so the summary and the report say what stays non-native).
    `vllm_prefix`: with `--all-packages`, where vLLM's files are (the source build can only
    help those)."""
    extensions = {a.name: a.as_record(stock_counts(stock, a.name)) for a in aot}
    for name, (jit, none) in left_by_aot(native_by_aot(aot), stock).items():
        before = stock_counts(stock, name)
        what = [f"{none} kernel(s) load nothing on {gpu}"] if none else []
        what += [f"{jit} stay JIT-only"] if jit else []
        report = stock.get(name)
        if report is not None and report.reach is not None and report.reach.chosen \
                and name not in extensions:
            why = (f"{' and '.join(what)}: aot would make the JIT-only ones native; not asked "
                   "(--only)")
        elif report is not None and report.reach is not None and report.reach.unreachable:
            why = f"{' and '.join(what)}: {unreachable_words(report.reach.unreachable)}"
        elif not gpu.has_source_rules:
            why = (f"{' and '.join(what)}: aot cannot change them, and a source build is for "
                   f"{DEFAULT_GPU} alone: only a release built for {gpu} makes them "
                   "native")
        elif vllm_prefix and not name.startswith(vllm_prefix):
            why = (f"{' and '.join(what)}: aot cannot change them; only a build of its "
                   "package for the GPU can")
        else:
            why = (f"{' and '.join(what)}: aot cannot change them; whether a source build can "
                   "was not decided (the source was not read: `sm121-build --base IMAGE "
                   "--source DIR` reads it)")
        extensions.setdefault(name, {
            "name": name, "target": extension_target(name), "before": before, "after": before,
            "build": False, "action": "keep", "reason": "kept: no source read", "remains": []})
        extensions[name]["remains"] = [why]
    return RunDecision(True, "; ".join(a.line() for a in aot), tuple(a.name for a in aot),
                       extensions)


def _source_if_needed(job: Job, aot: tuple[AotAction, ...], stock: dict[str, BinaryReport | None],
                      dest: Path) -> Checkout | None:
    """The source, when a kernel remains that aot cannot make native and the source can be
    had (a given --source always is); None otherwise, said."""
    opts = job.opts
    if opts.aot_only or (opts.only and opts.source is None):
        return None
    left = list(left_by_aot(native_by_aot(aot), stock))
    if not opts.gpu.has_source_rules:
        note(f"no guard rules for {opts.gpu} (a source build is for {DEFAULT_GPU}): aot "
             f"alone; what aot cannot change is left as it is ({', '.join(left)})")
        return None
    if not left and opts.source is None:
        note("every kernel that is not native has PTX: aot alone, no source needed")
        return None
    blocked = job.image.vllm.tools.blocking(job.image.facts.ref) \
        if job.image.vllm.tools is not None else None
    if blocked and opts.source is None:
        note(f"no source build in this image ({blocked}): what only a source build could "
             f"change is left as it is ({', '.join(left)}); aot goes on")
        return None
    try:
        return vllm_source(job, dest)
    except Sm121Error as exc:
        if opts.source is not None:
            raise
        note(f"the vLLM source cannot be had ({exc}): what only a source build could change "
             f"is left as it is ({', '.join(left)}); aot goes on; --source DIR builds them")
        return None


def files_root(job: Job) -> str:
    """The folder a run's files are named under: vLLM's package, or the image's root for
    `--all-packages` (files of every package, named by their path from `/`)."""
    return "/" if job.opts.all_packages else job.image.vllm.package_dir


def source_build_refused(gpu: Policy) -> str:
    """Why a source build's options are refused for `gpu` (one without guard rules)."""
    return (f"--gpu {gpu}: a source build (--source, --from-source, --force, --no-patch) is "
            f"for {DEFAULT_GPU} only (the guard rules are written for it); {gpu} gets aot: "
            "drop those options")


def builds_for_sure(opts: Options) -> bool:
    """Whether the run builds from source whatever the plan says (a --source given, or no
    aot: --from-source, --force, --no-patch): the image's compiler is checked up front, and
    the GPU must be one the guard rules cover."""
    certain = not opts.aot_only and (opts.source is not None or opts.from_source
                                     or opts.force or opts.no_patch)
    if certain and not opts.gpu.has_source_rules:
        raise Sm121Error(source_build_refused(opts.gpu))
    return certain


def resolve(pipeline: Pipeline, opts: Options) -> Resolved:
    """Pull when asked, inspect, and every check of the base made before any work: the
    result's tag is free, the image can build (a CUDA toolkit, the tools)."""
    facts, vllm = pipeline.resolve_image(opts.base, opts.pull)
    if not opts.plan_only:
        pipeline.require_tags_free(facts, [opts.tag], opts.replace_tag)
    if builds_for_sure(opts):  # aot compiles on this machine: it needs no compiler there
        require_buildable(vllm.tools, facts.ref)
    return Resolved(facts, vllm, version_to_ref(vllm.version, vllm.commit_id),
                    vllm.cuda_version or DEFAULT_CUDA, opts.arch)


def vllm_source(job: Job, dest: Path) -> Checkout:
    """The source at the image's commit (a checked --source, or fetched), copied to `dest`."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    record = pipeline.record
    with pipeline.steps.step(f"source ({image.ref})"):
        if opts.source:
            checkout = check_checkout(opts.source, image.ref, opts.allow_other_commit)
            record.source_checked(checkout.other_commit, checkout.changes)
            if checkout.other_commit:
                note(f"warning: {checkout.other_commit} (--allow-other-commit)")
            if checkout.changes:
                note(f"uncommitted changes in {checkout.path}: built as they are "
                     f"(sha256 {checkout.changes[:12]}, part of the content key)")
        else:
            checkout = Checkout(*fetch_source(image.ref, opts.repo), "", "")
        require_python_headers(image.vllm.tools, checkout.path, image.facts.ref)
        require_contained(checkout.path)  # the copy keeps links as links, all inside
        shutil.copytree(checkout.path, dest, ignore=shutil.ignore_patterns(".git"),
                        symlinks=True)
        note(f"{checkout.path} @ {checkout.commit}")
    return checkout


def stock_extensions(job: Job) -> dict[str, BinaryReport | None]:
    """The base's extensions, audited (and PTX newer than the run's GPU's driver, said)."""
    pipeline, image, gpu = job.pipeline, job.image, job.opts.gpu
    with pipeline.steps.step("audit the stock extensions"):
        stock = pipeline.read_stock(image.facts, image.vllm.extensions)
        too_new = ptx_warning(stock, gpu.target, gpu.driver)
        if too_new:
            note(too_new)
    return stock


def patch_vllm(job: Job, src: Path) -> None:
    """The guard rules on the copy of vLLM's tree at `src` (none with --no-patch)."""
    pipeline, opts = job.pipeline, job.opts
    with pipeline.steps.step("patch"):
        if opts.no_patch:
            note("patches skipped (--no-patch)")
            return
        for line in apply_for_build(src, {}, job.patch_for):
            note(line)


def patches_of(opts: Options) -> str:
    """The rules digest a build names (labels, manifest): `none` with --no-patch."""
    return "none" if opts.no_patch else rules_digest()
