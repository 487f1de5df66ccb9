"""The main job: pull -> inspect -> pin -> patch -> decide -> render -> build -> verify -> tag.

The pipeline's prelude (`Pipeline.resolve_image`), then what only a build does: the source
at the image's commit (and the external projects it pins), the content key and its skip, the
guard rules, the rebuild decision and the rendered Dockerfile; then the pipeline's tail
(`Pipeline.build_verify_tag`).  The temporary build context and the pin tag are removed on
any exit.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from sm121_build import __version__
from sm121_build.core.console import note, result
from sm121_build.core.errors import Sm121Error
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.labels import CONTENT_KEY_LABEL
from sm121_build.core.vllm import DEFAULT_EXTENSIONS, extension_target, projects
from sm121_build.cuda.binary import SPARK, BinaryReport, Policy, unreachable_words
from sm121_build.cuda.compat import SM121, ArchList
from sm121_build.cuda.ptxas import Toolchain
from sm121_build.image.facts import ImageFacts, VllmInstall
from sm121_build.image.refs import versioned_tag
from sm121_build.image.toolchain import (
    host_tools,
    place_host_tools,
    require_buildable,
    require_python_headers,
)
from sm121_build.jobs.commands.aot_step import (
    AotAction,
    AotJob,
    aot_actions,
    aot_key,
    aot_toolchain,
    compile_into,
)
from sm121_build.jobs.formats.artifacts import Provenance
from sm121_build.jobs.formats.render import (
    BuildPlan,
    Placement,
    PlanRequest,
    gpu_label,
    plan_for,
    provenance_labels,
    render_build,
    render_inject,
    template_digest,
)
from sm121_build.jobs.framework.pipeline import Delivery, ImageBuild, Pipeline
from sm121_build.jobs.framework.run_warnings import ptx_warning
from sm121_build.jobs.payload import PAYLOAD
from sm121_build.rebuild.decide import ExtensionPlan, decide_inputs, plan_extensions
from sm121_build.source.external import projects_for, read_pin
from sm121_build.source.git_pin import (
    Checkout,
    GitRef,
    check_checkout,
    copy_into,
    fetch_source,
    version_to_ref,
)
from sm121_build.source.guard_rules import (
    PatchFor,
    apply_for_build,
    rules_digest,
)
from sm121_build.source.guards import DEFAULT_CUDA
from sm121_build.source.tree import require_contained
from sm121_build.verify import run_report
from sm121_build.verify.run_report import RunDecision


@dataclass(frozen=True)
class Options:
    base: str
    tag: str
    arch: ArchList
    extra_ext: tuple[str, ...]
    jobs: int | None
    source: Path | None
    repo: str
    out: Path | None
    force: bool
    no_patch: bool
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
    gpu: Policy = SPARK  # --gpu: the GPU the run serves (and the driver it is judged with)


def content_key(facts: ImageFacts, commit: str, plan: Placement, no_patch: bool) -> str:
    parts = [facts.id, commit, "nopatch" if no_patch else rules_digest(), plan.arch_list,
             template_digest(), ",".join(plan.extensions), __version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def choose_to_build(job: Job, stock: dict[str, BinaryReport | None], source: Path,
                    aot: tuple[AotAction, ...] = ()) -> tuple[str, ...]:
    """The decide step: per stock extension, whether the build gives sm_121 native code it
    lacks (`decide.plan_extensions`); then --ext adds and --only restricts.  Empty: nothing
    to build (said, and recorded as not-needed)."""
    pipeline, opts = job.pipeline, job.opts
    arch_cmake, cuda = job.image.arch.cmake, job.image.cuda
    record, steps = pipeline.record, pipeline.steps
    names = {extension_target(n): n for n in stock}
    extra = tuple(e for e in opts.extra_ext if e != "auto")
    if opts.force:
        chosen = [n for n in stock if DEFAULT_EXTENSIONS.match(n.rsplit("/", 1)[-1])]
        plans: list[ExtensionPlan] = []
    else:
        with steps.step("decide"):
            plans = plan_extensions(stock, decide_inputs(source, arch_cmake, cuda, SM121),
                                    {t: p.name for p in projects() for t in p.targets})
            plans = [p for p in plans if not aot_does_as_well(p, aot)]
            for item in plans:
                note(item.line())
                for why in item.remains:
                    note(f"  {why}")
            for action in aot:
                note(action.line())
            chosen = [p.name for p in plans if p.build]
    for name in extra:
        file = names.get(extension_target(name), name)
        if file not in chosen:
            chosen.append(file)
    if opts.only:
        wanted = {extension_target(o) for o in opts.only}
        chosen = [n for n in chosen if extension_target(n) in wanted]
    built = [p for p in plans if p.name in chosen]
    reason = "forced (--force)" if opts.force else "; ".join(
        [f"{p.target}: {p.reason}" for p in built] + [a.line() for a in aot]) \
        or "no extension gains"
    extensions = {p.name: {**p.as_record(), "action": "build" if p.build else "keep"}
                  for p in plans}
    extensions.update({a.name: a.as_record(_before(stock, a.name)) for a in aot})
    record.decided(RunDecision(bool(chosen or aot), reason,
                            (*chosen, *(a.name for a in aot)), extensions))
    if not chosen and not aot:
        jit = sum(p.after["jit"] for p in plans)
        kept = "; ".join(f"{p.target}: {p.reason}" for p in plans if p.before != p.after
                         or p.before["jit"] or p.before["none"])
        result(f"no rebuild needed: no extension of {opts.base} gains native sm_121 code "
                   f"from a rebuild ({kept or 'every kernel is already native'})"
                   f"{f'; {jit} kernel(s) stay JIT-only' if jit else ''}; nothing tagged; "
                   "--force builds _C/_moe_C anyway, --ext NAME builds NAME")
    return tuple(chosen)


def aot_does_as_well(plan: ExtensionPlan, aot: tuple[AotAction, ...]) -> bool:
    """A source build of this extension makes no more kernels native than aot of its stock
    file: aot it (no compile of the source)."""
    action = next((a for a in aot if a.name == plan.name), None)
    return action is not None and plan.after["native"] <= plan.before["native"] + (
        action.able.kernels or 0)


def _before(stock: dict[str, BinaryReport | None], name: str) -> dict[str, int]:
    report = stock.get(name)
    if report is None or report.kernels is None:
        return {"native": 0, "jit": 0, "none": 0}
    return {str(verdict): n for verdict, n in report.kernel_counts().items()}


@dataclass(frozen=True)
class Resolved:
    """The base and what a build of it needs to know."""

    facts: ImageFacts
    vllm: VllmInstall
    ref: GitRef  # the vLLM commit (or tag) the image was built from
    cuda: str  # the image's CUDA toolkit, X.Y
    arch: ArchList  # what to build for, in torch's and CMake's forms
    gpu: Policy = SPARK  # the GPU the run serves (--gpu)

    @property
    def patch_for(self) -> PatchFor:
        """What the source trees are patched for: this vLLM, arch list, CUDA, sm_121."""
        return PatchFor(self.vllm.version, self.arch.cmake, self.cuda, SM121)


@dataclass(frozen=True)
class Sources:
    """What the build compiles: vLLM at `commit` and the external projects' trees."""

    commit: str
    provenance: str  # commit[+changes], then `\0project@commit+changes` per project
    external: tuple[tuple[str, str], ...] = ()  # (environment variable, context folder)
    tree: Path | None = None  # vLLM's tree in the build context (None: no source build)


@dataclass(frozen=True)
class Job:
    """One run of the main job as its stages see it: the pipeline (engine, record, steps),
    the options, and the base resolved."""

    pipeline: Pipeline
    opts: Options
    image: Resolved


@dataclass(frozen=True)
class ExtensionActions:
    """The run's plan, per extension: the files aot makes native from their own PTX, and the
    ones built from the source (every other extension is kept as the base has it); with the
    source they were decided on, when it was read, and the ptxas aot uses."""

    aot: tuple[AotAction, ...]
    build: tuple[str, ...]
    checkout: Checkout | None
    toolchain: Toolchain | None  # None: nothing to aot

    def line(self, arch: ArchList) -> str:
        """`aot A, B; build C for 12.1`."""
        parts = ([f"aot {', '.join(a.name for a in self.aot)}"] if self.aot else []) + \
            ([f"build {', '.join(self.build)}"] if self.build else [])
        return f"{'; '.join(parts)} for {arch}"


def run_build(pipeline: Pipeline, opts: Options) -> str:
    """The main job, a stage a line; returns the tag (the record says how the run ended)."""
    pipeline.gpu = opts.gpu
    pipeline.record.serves(str(opts.gpu))
    note(f"for {opts.gpu}: " + ("a DGX Spark's GB10 (the default; --gpu names another GPU)"
                                if opts.gpu == SPARK else
                                "--gpu; aot alone (a source build is for sm_121)"))
    image = resolve(pipeline, opts)
    job = Job(pipeline, opts, image)
    with temp_dir("sm121-build-") as tmp:
        context = Path(tmp)
        actions = plan_actions(job, context)
        if actions is None:  # nothing gains (said and recorded)
            return opts.tag
        if opts.plan_only:
            pipeline.record.ended(run_report.RunStatus.PLANNED)
            result(f"plan: {actions.line(opts.arch)}; nothing built (--plan)")
            return opts.tag
        return carry_out(job, actions, context)


def plan_actions(job: Job, context: Path) -> ExtensionActions | None:
    """The decide step: which extensions aot makes native (none with --from-source, --force
    or --no-patch), and which a source build improves, read from the source when it is
    needed (always without aot; with aot, only when a kernel aot cannot make native remains
    and the source can be had).  None: nothing to do, said and recorded."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    aot, stock = planned_aot(job)
    if not aot and (opts.aot_only or not opts.gpu.has_source_rules):
        pipeline.record.decided(RunDecision(False, "nothing to aot"))
        result(f"nothing to aot: no extension of {opts.base} has JIT-only kernels with PTX "
               f"on {opts.gpu}; nothing tagged")
        return None
    toolchain: Toolchain | None = None
    if aot:
        toolchain = aot_toolchain()  # this machine's ptxas, before any work
        checkout = _source_if_needed(job, aot, stock, context / "src")
    else:
        require_buildable(image.vllm.tools, image.facts.ref)  # a build, before any fetch
        checkout = vllm_source(job, context / "src")
        stock = stock or stock_extensions(pipeline, image)
    chosen: tuple[str, ...] = ()
    if checkout is not None:
        patch_vllm(job, context / "src")
        chosen = choose_to_build(job, stock, context / "src", aot)
    else:
        with pipeline.steps.step("decide"):
            for action in aot:
                note(action.line())
            choose_record(pipeline, aot, stock,
                          image.vllm.package_dir.lstrip("/") + "/" if opts.all_packages else "")
    if not chosen and not aot:
        return None
    return ExtensionActions(aot, chosen, checkout, toolchain)


def planned_aot(job: Job) -> tuple[tuple[AotAction, ...], dict[str, BinaryReport | None]]:
    """The extensions aot makes native (none with --from-source or --force), and the stock
    audit it read for them (empty when it read none)."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    if opts.from_source or opts.force or opts.no_patch:
        return (), {}
    stock = pipeline.read_device_files(image.facts) if opts.all_packages \
        else stock_extensions(pipeline, image)
    aot = aot_actions(stock, opts.gpu.target)
    if opts.only:
        wanted = {extension_target(o) for o in opts.only}
        aot = tuple(a for a in aot if extension_target(a.name) in wanted)
    return aot, stock


def carry_out(job: Job, actions: ExtensionActions, context: Path) -> str:
    """The plan's actions: an image this tool built for the same content key is tagged
    (nothing compiles); else aot on this machine, then a source build with the aot'd files
    copied in (when anything is built from source) or the aot'd files alone into the pristine
    base."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    aot, chosen, checkout, toolchain = actions.aot, actions.build, actions.checkout, \
        actions.toolchain
    prebuilt = tuple(a.name for a in aot)
    if chosen and checkout is not None:  # from source, with the aot'd files in it if any
        sources = external_sources(job, context, checkout, chosen)
        plan: Placement = replace(plan_for(image.facts, source_plan(job, chosen, sources)),
                                  prebuilt=prebuilt)
        provenance, patches = sources.provenance, patches_of(opts)
        if toolchain is not None:
            provenance += "\0" + aot_key(image.facts.id, aot, toolchain, opts.gpu.target)
            patches += f"+{aot_patches(toolchain)}"
        key = content_key(image.facts, provenance, plan, opts.no_patch)
    elif toolchain is not None:  # aot alone: the aot'd files into the pristine base
        commit = image.vllm.commit_id or image.ref.value
        sources = Sources(commit, commit)
        patches = aot_patches(toolchain)
        plan = aot_plan(image, prebuilt, commit, patches, files_root(job))
        key = aot_key(image.facts.id, aot, toolchain, opts.gpu.target)
    else:  # plan_actions returns None when there is neither
        raise AssertionError("a plan with nothing to aot or build")
    target = replace(target_for(job, sources, plan, key, patches),
                     origins=tuple((name, "aot") for name in prebuilt))
    existing = None if opts.force else pipeline.reusable(key)
    if existing:
        return up_to_date(job, plan, target, existing)  # nothing compiles, aot included
    if toolchain is not None:
        with pipeline.steps.step(f"aot ({len(aot)} file(s), {toolchain})"):
            compile_into(pipeline.engine,
                         AotJob(image.facts.id, files_root(job), aot, toolchain,
                                opts.gpu.target),
                         context / "aot")
    if isinstance(plan, BuildPlan):
        return build(job, plan, target, context)
    return inject_aot(job, plan, target, context)


def choose_record(pipeline: Pipeline, aot: tuple[AotAction, ...],
                  stock: dict[str, BinaryReport | None], vllm_prefix: str = "") -> None:
    """The decision of a run without the source: the aot actions, and every extension left
    with kernels aot cannot make native (kept, its reason in `remains`, so the summary and
    the report say what stays non-native).  `vllm_prefix`: with `--all-packages`, where
    vLLM's files are (the source build can only help those)."""
    extensions = {a.name: a.as_record(_before(stock, a.name)) for a in aot}
    for name, (jit, none) in left_by_aot(aot, stock).items():
        before = _before(stock, name)
        what = [f"{none} kernel(s) load nothing on {pipeline.gpu}"] if none else []
        what += [f"{jit} stay JIT-only"] if jit else []
        report = stock.get(name)
        if report is not None and report.reach is not None and report.reach.chosen \
                and name not in extensions:
            why = (f"{' and '.join(what)}: aot would make the JIT-only ones native; not asked "
                   "(--only)")
        elif report is not None and report.reach is not None and report.reach.unreachable:
            why = f"{' and '.join(what)}: {unreachable_words(report.reach.unreachable)}"
        elif not pipeline.gpu.has_source_rules:
            why = (f"{' and '.join(what)}: aot cannot change them, and a source build is for "
                   f"sm_121 alone: only a release built for {pipeline.gpu} makes them native")
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
    pipeline.record.decided(RunDecision(
        True, "; ".join(a.line() for a in aot), tuple(a.name for a in aot), extensions))


def left_by_aot(aot: tuple[AotAction, ...],
                stock: dict[str, BinaryReport | None]) -> dict[str, tuple[int, int]]:
    """Per stock extension with any, its kernels that stay non-native after aot: (still
    JIT-only, loading nothing); aot makes JIT-only kernels native and no others."""
    covered = {a.name: a.able.kernels or 0 for a in aot}
    left = {}
    for name, report in stock.items():
        if report is None or report.kernels is None:
            continue
        counts = _before(stock, name)
        jit, none = max(counts["jit"] - covered.get(name, 0), 0), counts["none"]
        if jit or none:
            left[name] = (jit, none)
    return left


def _source_if_needed(job: Job, aot: tuple[AotAction, ...], stock: dict[str, BinaryReport | None],
                      dest: Path) -> Checkout | None:
    """The source, when a kernel remains that aot cannot make native and the source can be
    had (a given --source always is); None otherwise, said."""
    opts = job.opts
    if opts.aot_only or (opts.only and opts.source is None):
        return None
    if not opts.gpu.has_source_rules:
        note(f"no guard rules for {opts.gpu} (a source build is for sm_121): aot alone; what "
             f"aot cannot change is left as it is ({', '.join(left_by_aot(aot, stock))})")
        return None
    left = list(left_by_aot(aot, stock))
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


def aot_patches(toolchain: Toolchain) -> str:
    """What the manifest's and labels' `patches` say of aot'd files: no guard rule, and the
    ptxas that compiled them (so a kernels image's reuse key tells them apart)."""
    return f"aot-ptxas-{toolchain.version}"


def files_root(job: Job) -> str:
    """The folder a run's files are named under: vLLM's package, or the image's root for
    `--all-packages` (files of every package, named by their path from `/`)."""
    return "/" if job.opts.all_packages else job.image.vllm.package_dir


def aot_plan(image: Resolved, files: tuple[str, ...], commit: str, patches: str,
             root: str) -> Placement:
    """The plan of an aot-only run: its files copied into the pristine base, named under
    `root`."""
    labels = provenance_labels(image.facts, commit, image.arch, files, patches) \
        | gpu_label(str(image.gpu))
    return Placement(base="", arch_list=str(image.arch), vllm_version=image.vllm.version,
                     git_ref=commit, extensions=files, package_dir=root, labels=labels)


def inject_aot(job: Job, plan: Placement,
               target: Delivery, context: Path) -> str:
    """The aot'd files into a temporary tag of exactly the base -> verify -> tag."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    log = pipeline.new_log(f"aot-{target.content_key}")
    dockerfile = context / "Dockerfile"
    with pipeline.engine.pinned(image.facts.id) as pin:
        dockerfile.write_text(render_inject(replace(plan, base=pin), artifacts="aot",
                                            more={CONTENT_KEY_LABEL: target.content_key}))
        pipeline.build_verify_tag(
            ImageBuild(image.facts, context, dockerfile, plan.extensions, log,
                       f"inject the aot'd {', '.join(plan.extensions)}"), target)
    pipeline.record.ended(run_report.RunStatus.BUILT)
    run_report.remember(pipeline.record)
    result(f"tagged {', '.join(target.tags)}  (log: {log})")
    return opts.tag


def builds_for_sure(opts: Options) -> bool:
    """Whether the run builds from source whatever the plan says (a --source given, or no
    aot: --from-source, --force, --no-patch): the image's compiler is checked up front, and
    the GPU must be one the guard rules cover."""
    certain = not opts.aot_only and (opts.source is not None or opts.from_source
                                     or opts.force or opts.no_patch)
    if certain and not opts.gpu.has_source_rules:
        raise Sm121Error(f"--gpu {opts.gpu}: a source build (--source, --from-source, --force, "
                         "--no-patch) is for sm_121 only (the guard rules are written for it); "
                         f"{opts.gpu} gets aot: drop those options")
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
                    vllm.cuda_version or DEFAULT_CUDA, opts.arch, opts.gpu)


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


def stock_extensions(pipeline: Pipeline, image: Resolved) -> dict[str, BinaryReport | None]:
    """The base's extensions, audited (and PTX newer than a Spark's driver, said)."""
    with pipeline.steps.step("audit the stock extensions"):
        stock = pipeline.read_stock(image.facts, image.vllm.extensions)
        too_new = ptx_warning(stock, pipeline.gpu.target, pipeline.gpu.driver)
        if too_new:
            note(too_new)
    return stock


def patch_vllm(job: Job, src: Path) -> None:
    pipeline, opts, image = job.pipeline, job.opts, job.image
    with pipeline.steps.step("patch"):
        if opts.no_patch:
            note("patches skipped (--no-patch)")
            return
        for line in apply_for_build(src, {}, image.patch_for):
            note(line)


def external_sources(job: Job, context: Path,
                     checkout: Checkout, chosen: tuple[str, ...]) -> Sources:
    """The trees of the external projects the chosen extensions live in (flash-attention at
    the commit vLLM pins), copied into the context, with their rules applied."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    provenance = checkout.commit + (f"+{checkout.changes}" if checkout.changes else "")
    projects = projects_for([extension_target(name) for name in chosen], opts.fa_source)
    if not projects:
        return Sources(checkout.commit, provenance, tree=context / "src")
    external: list[tuple[str, str]] = []
    with pipeline.steps.step("external sources"):
        for project in projects:
            declared = read_pin(context / "src", project)
            got = copy_into(declared, opts.fa_source, context / project.name,
                            opts.allow_other_commit)
            external.append((project.env, project.name))
            pipeline.record.external_copied(project.name, run_report.ExternalSource(
                got.commit, declared.repository, got.changes, got.other_commit))
            provenance += f"\0{project.name}@{got.commit}+{got.changes}"
            if got.other_commit:
                note(f"warning: {got.other_commit} (--allow-other-commit)")
            note(f"{project.name} {got.commit[:12]} (pinned in {declared.declared_in}): "
                 f"{got.path}")
        if not opts.no_patch:
            trees = {folder: context / folder for _env, folder in external}
            for line in apply_for_build(context / "src", trees, image.patch_for, vllm=False):
                note(line)
    return Sources(checkout.commit, provenance, tuple(external), context / "src")


def source_plan(job: Job, chosen: tuple[str, ...],
                sources: Sources) -> PlanRequest:
    """What a source build of `chosen` asks the plan for."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    return PlanRequest(image.arch, chosen, str(image.ref),
                       pipeline.engine.buildkit_client() is not None, opts.jobs,
                       sources.tree, sources.commit, defaults=False,
                       external=sources.external, patches=patches_of(opts))


def patches_of(opts: Options) -> str:
    """The rules digest a build names (labels, manifest): `none` with --no-patch."""
    return "none" if opts.no_patch else rules_digest()


def target_for(job: Job, sources: Sources,
                  plan: Placement, key: str, patches: str | None = None) -> Delivery:
    """Where the verified image goes (tags, --out) and what its files' manifest says."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    record, facts, vllm = pipeline.record, image.facts, image.vllm
    record.build_named(vllm.version, sources.commit, plan.arch_list, key, plan.extensions)
    provenance = Provenance(
        base=facts.ref, base_digest=facts.digest_ref, vllm_version=vllm.version,
        vllm_commit=sources.commit, vllm_commit_id=vllm.commit_id, arch_list=plan.arch_list,
        patches=patches or patches_of(opts), package_dir=plan.package_dir,
        tool_version=__version__,
        external={name: entry.commit for name, entry in record.external.items()},
        torch_version=vllm.torch_version, platform=facts.platform, gpu=str(opts.gpu))
    also = (versioned_tag(opts.tag, vllm.version, sources.commit, facts.id),) \
        if opts.versioned_tag else ()
    return Delivery(opts.tag, opts.out, provenance, also, opts.replace_tag, key)


def up_to_date(job: Job, plan: Placement,
               target: Delivery, existing: str) -> str:
    """The content key names an image this tool built: tag it (and export --out, verified
    as after a build); nothing compiles."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    record = pipeline.record
    record.keep_audit_of(run_report.recall(target.content_key) or {})
    record.ended(run_report.RunStatus.UP_TO_DATE)
    if opts.out:
        with pipeline.steps.step("verify"):
            pipeline.verify_and_export(image.facts, existing,
                                       (*plan.extensions, *plan.prebuilt), (None, None), target)
    pipeline.tag_result(image.facts, existing, target)
    # `aot IMAGE` has no --force: the same aot makes the same image
    result(f"up to date: {', '.join(target.tags)} (content key {target.content_key})"
           f"{'' if opts.aot_only else '; --force rebuilds'}")
    return opts.tag


def build(job: Job, plan: BuildPlan,
          target: Delivery, context: Path) -> str:
    """Render the Dockerfile (FROM a temporary tag of exactly the base), bring what the
    builder lacks, build -> verify -> tag."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    log = pipeline.new_log(f"build-{target.content_key}")
    dockerfile = context / "Dockerfile"
    with pipeline.engine.pinned(image.facts.id) as pin:
        dockerfile.write_text(render_build(plan, {CONTENT_KEY_LABEL: target.content_key}, base=pin))
        if plan.bring:
            note(f"the builder brings {' and '.join(plan.bring)} ("
                 f"{'this machine' if plan.bring_from == 'context' else 'pip'})")
        found = host_tools() if plan.bring_from == "context" else None
        if found:
            place_host_tools(found, plan.bring, context)
        shutil.copy2(PAYLOAD, context / "build_extensions.py")
        aot = f", with the aot'd {', '.join(plan.prebuilt)}" if plan.prebuilt else ""
        pipeline.build_verify_tag(
            ImageBuild(image.facts, context, dockerfile, (*plan.extensions, *plan.prebuilt), log,
                       f"build {', '.join(plan.extensions)} for {opts.arch}{aot}"), target)
    pipeline.record.ended(run_report.RunStatus.BUILT)
    run_report.remember(pipeline.record)
    result(f"tagged {', '.join(target.tags)}  (log: {log})")
    return opts.tag
