"""The main job, carried out: `run_build` plans the run's actions (`main_plan.py`), says
them for `--plan`, or gathers what the build needs (`gather_for_build`: the external
sources, the engine's BuildKit, the digests), decides its layout and content key of those
alone (`decide_build`) and carries it out (`carry_out`): an image this tool built for the
same content key is tagged; else aot on this machine (the aot'd files injected into a
temporary tag of exactly the base), or a source build FROM it (the rendered Dockerfile, with
the aot'd files copied in); then the pipeline's tail (`Pipeline.build_verify_tag`: verify,
tag, --out).  The temporary build context and the pin tag are removed on any exit.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from sm121_build import __version__
from sm121_build.core.console import note, result
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.labels import CONTENT_KEY_LABEL
from sm121_build.core.vllm import extension_target
from sm121_build.cuda.compat import DEFAULT_TARGET
from sm121_build.cuda.ptxas import Toolchain
from sm121_build.image.build_tools import (
    host_tools,
    place_host_tools,
)
from sm121_build.image.facts import ImageFacts
from sm121_build.image.refs import versioned_tag
from sm121_build.jobs.aot_work.aot_step import (
    AotJob,
    aot_key,
    compile_into,
)
from sm121_build.jobs.formats.artifacts import Provenance
from sm121_build.jobs.formats.render import (
    BuildLayout,
    LayoutRequest,
    Placement,
    aot_label,
    default_jobs,
    gpu_label,
    layout_for,
    provenance_labels,
    render_build,
    render_inject,
    template_digest,
)
from sm121_build.jobs.framework import run_record
from sm121_build.jobs.framework.pipeline import Delivery, ImageBuild, Pipeline, say_tagged
from sm121_build.jobs.main_run.main_plan import (
    ExtensionActions,
    Job,
    NothingToDo,
    Options,
    Sources,
    files_root,
    patches_of,
    plan_actions,
    resolve,
)
from sm121_build.jobs.payload import PAYLOAD
from sm121_build.source.external import projects_for, read_pin, source_targets
from sm121_build.source.git_pin import (
    Checkout,
    copy_into,
)
from sm121_build.source.guard_rules import (
    apply_for_build,
    rules_digest,
)


def content_key(facts: ImageFacts, provenance: tuple[str, ...], layout: Placement,
                rules: str, templates: str) -> str:
    """The key of a build: the base, the trees it compiles (`Sources.provenance`), the
    guard rules (`rules_digest`, or "nopatch" with --no-patch), the arch list, the templates
    (`template_digest`), the extensions and the tool's version."""
    parts = [facts.id, *provenance, rules, layout.arch_list, templates,
             ",".join(layout.extensions), __version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class BuildFacts:
    """What deciding a plan's build needs beyond the plan, gathered once
    (`gather_for_build`): the trees a source build compiles and the CMake targets vLLM's
    defines (None for aot alone), whether the engine builds with BuildKit, the build's
    jobs, and the digests of the guard rules ("" with --no-patch) and of the templates."""

    sources: Sources | None
    targets: frozenset[str] | None
    buildkit: bool
    jobs: int
    rules: str
    templates: str


@dataclass(frozen=True)
class BuildDecision:
    """The build a plan comes to, decided of the gathered facts alone (`decide_build`): its
    layout (a `BuildLayout` from source, or the aot'd files' `Placement`), its content key,
    the trees it is made of and what its manifest's `patches` says."""

    layout: Placement
    key: str
    sources: Sources
    patches: str


def run_build(pipeline: Pipeline, opts: Options) -> str:
    """The main job, a stage a line; returns the tag (the record says how the run ended)."""
    note(f"for {opts.gpu}: " + (f"{opts.gpu.target.facts.machine} (the default; --gpu names "
                                "another GPU)" if opts.gpu.is_default else
                                f"--gpu; aot alone (a source build is for {DEFAULT_TARGET})"))
    image = resolve(pipeline, opts)
    job = Job(pipeline, opts, image)
    with temp_dir("sm121-build-") as tmp:
        context = Path(tmp)
        actions = plan_actions(job, context)
        if isinstance(actions, NothingToDo):  # nothing gains
            return ended_with_nothing_to_do(pipeline, actions, opts.tag)
        if opts.plan_only:
            pipeline.record.ended(run_record.RunStatus.PLANNED)
            result(f"plan: {actions.line(opts.arch)}; nothing built (--plan)")
            return opts.tag
        decision = decide_build(job, actions, gather_for_build(job, actions, context))
        return carry_out(job, actions, decision, context)


def ended_with_nothing_to_do(pipeline: Pipeline, nothing: NothingToDo, tag: str) -> str:
    """The run's end when the decide step found nothing that gains: its decision recorded and
    its line said (where the step had not done so already); nothing is tagged."""
    if nothing.decision is not None:
        pipeline.record.decided(nothing.decision)
    if nothing.line:
        result(nothing.line)
    return tag


def gather_for_build(job: Job, actions: ExtensionActions, context: Path) -> BuildFacts:
    """What the build needs beyond the plan: for a source build, the external projects'
    trees copied and patched (`external_sources`), the CMake targets vLLM's tree defines,
    whether the engine has BuildKit and the guard rules' and templates' digests; the jobs."""
    opts = job.opts
    jobs = opts.jobs or default_jobs()
    if not actions.build or actions.checkout is None:  # aot alone: nothing more to gather
        return BuildFacts(None, None, False, jobs, "", "")
    sources = external_sources(job, context, actions.checkout, actions.build)
    return BuildFacts(sources, frozenset(source_targets(sources.tree or context / "src")),
                      job.pipeline.engine.buildkit_client() is not None, jobs,
                      "" if opts.no_patch else rules_digest(), template_digest())


def decide_build(job: Job, actions: ExtensionActions, gathered: BuildFacts) -> BuildDecision:
    """The build's layout and content key, of the plan, the options, the base resolved and
    the gathered facts alone (no file, engine, network or program): a source build with the
    aot'd files in it if any, or the aot'd files alone into the pristine base."""
    opts, image = job.opts, job.image
    aot, toolchain = actions.aot, actions.toolchain
    prebuilt = actions.prebuilt
    if gathered.sources is not None:  # from source, with the aot'd files in it if any
        sources = gathered.sources
        patches = "none" if opts.no_patch else gathered.rules  # as `patches_of` says it
        built = layout_for(image.facts, LayoutRequest(
            image.arch, actions.build, str(image.ref), gathered.buildkit, gathered.jobs,
            gathered.targets, sources.commit, defaults=False, external=sources.external,
            patches=patches))
        layout: Placement = replace(built, prebuilt=prebuilt,
                                    labels=built.labels | aot_label(prebuilt))
        provenance = sources.provenance
        if toolchain is not None:
            provenance += (aot_key(image.facts.id, aot, toolchain, opts.gpu.target),)
            patches += f"+{aot_patches(toolchain)}"
        return BuildDecision(layout, content_key(
            image.facts, provenance, layout, "nopatch" if opts.no_patch else gathered.rules,
            gathered.templates), sources, patches)
    if toolchain is None:  # plan_actions returns NothingToDo when there is neither
        raise AssertionError("a plan with nothing to aot or build")
    commit = image.vllm.commit_id or image.ref.value
    patches = aot_patches(toolchain)
    return BuildDecision(aot_layout(job, prebuilt, commit, patches),
                         aot_key(image.facts.id, aot, toolchain, opts.gpu.target),
                         Sources(commit, (commit,)), patches)


def carry_out(job: Job, actions: ExtensionActions, decision: BuildDecision,
              context: Path) -> str:
    """The plan's actions, as decided: an image this tool built for the same content key is
    tagged (nothing compiles); else aot on this machine, then a source build with the aot'd
    files copied in (when anything is built from source) or the aot'd files alone into the
    pristine base."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    aot, toolchain = actions.aot, actions.toolchain
    prebuilt = actions.prebuilt
    layout, key, sources, patches = decision.layout, decision.key, decision.sources, \
        decision.patches
    pipeline.record.build_named(image.vllm.version, sources.commit, image.arch, key,
                                layout.extensions)
    delivery = replace(delivery_for(job, sources, layout, key, patches),
                     origins=tuple((name, "aot") for name in prebuilt))
    existing = None if opts.force else pipeline.reusable(key)
    if existing:
        return up_to_date(job, layout, delivery, existing)  # nothing compiles, aot included
    if toolchain is not None:
        with pipeline.steps.step(f"aot ({len(aot)} file(s), {toolchain})"):
            compile_into(pipeline.engine,
                         AotJob(image.facts.id, files_root(job), aot, toolchain,
                                opts.gpu.target),
                         context / "aot")
    if isinstance(layout, BuildLayout):
        return build(job, layout, delivery, context)
    return inject_aot(job, layout, delivery, context)


def aot_patches(toolchain: Toolchain) -> str:
    """What the manifest's and labels' `patches` say of aot'd files: no guard rule, and the
    ptxas that compiled them (so a kernels image's reuse key tells them apart)."""
    return f"aot-ptxas-{toolchain.version}"


def aot_layout(job: Job, files: tuple[str, ...], commit: str, patches: str) -> Placement:
    """The layout of an aot-only run: its files copied into the pristine base, named under
    the run's files root (`files_root`), labelled with the run's GPU."""
    image = job.image
    labels = provenance_labels(image.facts, commit, image.arch, files, patches) \
        | gpu_label(str(job.opts.gpu))
    return Placement(base="", arch_list=str(image.arch), vllm_version=image.vllm.version,
                     git_ref=commit, extensions=files, package_dir=files_root(job),
                     labels=labels)


def _tagged(job: Job, delivery: Delivery, log: Path) -> str:
    """The end of a run whose image was built and tagged (a source build, or the aot'd
    files injected): the record ended as built and kept, the one `tagged` line; its tag."""
    job.pipeline.record.ended(run_record.RunStatus.BUILT)
    run_record.remember(job.pipeline.record)
    say_tagged(delivery, log)
    return job.opts.tag


def inject_aot(job: Job, layout: Placement,
               delivery: Delivery, context: Path) -> str:
    """The aot'd files into a temporary tag of exactly the base -> verify -> tag."""
    pipeline, image = job.pipeline, job.image
    log = pipeline.new_log(f"aot-{delivery.content_key}")
    dockerfile = context / "Dockerfile"
    with pipeline.engine.pinned(image.facts.id) as pin:
        dockerfile.write_text(render_inject(replace(layout, base=pin), artifacts="aot",
                                            more={CONTENT_KEY_LABEL: delivery.content_key}))
        pipeline.build_verify_tag(
            ImageBuild(image.facts, context, dockerfile, layout.extensions, log,
                       f"inject the aot'd {', '.join(layout.extensions)}"), delivery)
    return _tagged(job, delivery, log)


def external_sources(job: Job, context: Path,
                     checkout: Checkout, chosen: tuple[str, ...]) -> Sources:
    """The trees of the external projects the chosen extensions live in (flash-attention at
    the commit vLLM pins), copied into the context, with their rules applied."""
    pipeline, opts = job.pipeline, job.opts
    provenance: tuple[str, ...] = (
        checkout.commit + (f"+{checkout.changes}" if checkout.changes else ""),)
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
            pipeline.record.external_copied(project.name, run_record.ExternalSource(
                got.commit, declared.repository, got.changes, got.other_commit))
            provenance += (f"{project.name}@{got.commit}+{got.changes}",)
            if got.other_commit:
                note(f"warning: {got.other_commit} (--allow-other-commit)")
            note(f"{project.name} {got.commit[:12]} (pinned in {declared.declared_in}): "
                 f"{got.path}")
        if not opts.no_patch:
            trees = {folder: context / folder for _env, folder in external}
            for line in apply_for_build(context / "src", trees, job.patch_for, vllm=False):
                note(line)
    return Sources(checkout.commit, provenance, tuple(external), context / "src")


def delivery_for(job: Job, sources: Sources,
                 layout: Placement, key: str, patches: str | None = None) -> Delivery:
    """Where the verified image goes (tags, --out) and what its files' manifest says."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    record, facts, vllm = pipeline.record, image.facts, image.vllm
    provenance = Provenance(
        base=facts.ref, base_digest=facts.digest_ref, vllm_version=vllm.version,
        vllm_commit=sources.commit, vllm_commit_id=vllm.commit_id, arch_list=layout.arch_list,
        patches=patches or patches_of(opts), package_dir=layout.package_dir,
        tool_version=__version__,
        external={name: entry.commit for name, entry in record.external.items()},
        torch_version=vllm.torch_version, platform=facts.platform, gpu=str(opts.gpu))
    also = (versioned_tag(opts.tag, vllm.version, sources.commit, facts.id),) \
        if opts.versioned_tag else ()
    return Delivery(opts.tag, opts.out, provenance, also, opts.replace_tag, key)


def up_to_date(job: Job, layout: Placement,
               delivery: Delivery, existing: str) -> str:
    """The content key names an image this tool built: tag it (and export --out, verified
    as after a build); nothing compiles."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    record = pipeline.record
    record.keep_audit_of(run_record.recall(delivery.content_key) or {})
    record.ended(run_record.RunStatus.UP_TO_DATE)
    if opts.out:
        with pipeline.steps.step("verify"):
            pipeline.verify_and_export(image.facts, existing,
                                       (*layout.extensions, *layout.prebuilt), (None, None),
                                       delivery)
    pipeline.tag_result(image.facts, existing, delivery)
    # `aot IMAGE` has no --force: the same aot makes the same image
    result(f"up to date: {', '.join(delivery.tags)} (content key {delivery.content_key})"
           f"{'' if opts.aot_only else '; --force rebuilds'}")
    return opts.tag


def build(job: Job, layout: BuildLayout,
          delivery: Delivery, context: Path) -> str:
    """Render the Dockerfile (FROM a temporary tag of exactly the base), bring what the
    builder lacks, build -> verify -> tag."""
    pipeline, opts, image = job.pipeline, job.opts, job.image
    log = pipeline.new_log(f"build-{delivery.content_key}")
    dockerfile = context / "Dockerfile"
    with pipeline.engine.pinned(image.facts.id) as pin:
        dockerfile.write_text(render_build(layout, {CONTENT_KEY_LABEL: delivery.content_key},
                                           base=pin))
        if layout.bring:
            note(f"the builder brings {' and '.join(layout.bring)} ("
                 f"{'this machine' if layout.bring_from == 'context' else 'pip'})")
        found = host_tools() if layout.bring_from == "context" else None
        if found:
            place_host_tools(found, layout.bring, context)
        shutil.copy2(PAYLOAD, context / "build_extensions.py")
        aot = f", with the aot'd {', '.join(layout.prebuilt)}" if layout.prebuilt else ""
        pipeline.build_verify_tag(
            ImageBuild(image.facts, context, dockerfile,
                       (*layout.extensions, *layout.prebuilt), log,
                       f"build {', '.join(layout.extensions)} for {opts.arch}{aot}"), delivery)
    return _tagged(job, delivery, log)
