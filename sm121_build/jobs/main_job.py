"""The main job: pull -> inspect -> pin -> patch -> decide -> render -> build -> verify -> tag.

The pipeline's prelude (`Pipeline.resolve_image`), then what only a build does: the source
at the image's commit (and the external projects it pins), the content key and its skip, the
guard rules, the rebuild decision and the rendered Dockerfile; then the pipeline's tail
(`Pipeline.finish`).  The temporary build context and the pin tag are removed on any exit.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from sm121_build import __version__
from sm121_build.core.console import note, result
from sm121_build.core.labels import CONTENT_KEY_LABEL, LABEL_PREFIX
from sm121_build.core.vllm import DEFAULT_EXTENSIONS, extension_target, projects
from sm121_build.cuda.binary import SM121, BinaryReport
from sm121_build.image.facts import ImageFacts
from sm121_build.image.refs import versioned_tag
from sm121_build.image.toolchain import (
    host_tools,
    place_host_tools,
    require_buildable,
    require_python_headers,
)
from sm121_build.jobs.artifacts import Provenance
from sm121_build.jobs.pipeline import Finish, Pipeline
from sm121_build.jobs.render import BuildPlan, plan_for, render, template_digest
from sm121_build.jobs.warnings import ptx_warning
from sm121_build.rebuild.decide import ExtensionPlan, decide_inputs, plan_extensions
from sm121_build.source.external import projects_for, read_pin
from sm121_build.source.guards import DEFAULT_CUDA, cmake_arch_list
from sm121_build.source.patch import (
    apply_for_build,
    rules_digest,
)
from sm121_build.source.pin import check_checkout, copy_into, fetch_source, version_to_ref
from sm121_build.verify import run_report


@dataclass(frozen=True)
class Options:
    base: str
    tag: str
    arch: str
    extra_ext: tuple[str, ...]
    jobs: int | None
    source: Path | None
    repo: str
    out: Path | None
    force: bool
    no_patch: bool
    pull: str = "never"  # "always" (like docker build --pull), "missing" or "never"
    versioned_tag: bool = False  # also tag <tag>-<vLLM version>-<commit>
    allow_other_commit: bool = False  # build a --source at another commit than the image's
    fa_source: Path | None = None  # a local flash-attention checkout
    only: tuple[str, ...] = ()  # --only: build no other extension than these
    plan_only: bool = False  # --plan: decide, say the plan, build nothing
    replace_tag: bool = False  # --replace-tag: --tag may move off an image we did not build


def content_key(facts: ImageFacts, commit: str, plan: BuildPlan, no_patch: bool) -> str:
    parts = [facts.id, commit, "nopatch" if no_patch else rules_digest(), plan.arch_list,
             template_digest(), ",".join(plan.extensions), __version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def choose_to_build(pipeline: Pipeline, opts: Options, stock: dict[str, BinaryReport | None],
                    source: Path, arch_cmake: str, cuda: str) -> tuple[str, ...]:
    """The decide step: per stock extension, whether the build gives sm_121 native code it
    lacks (`decide.plan_extensions`); then --ext adds and --only restricts.  Empty: nothing
    to build (said, and recorded as not-needed)."""
    record, steps = pipeline.record, pipeline.steps
    names = {extension_target(n): n for n in stock}
    extra = tuple(e for e in opts.extra_ext if e != "auto")
    if opts.force:
        chosen = [n for n in stock if DEFAULT_EXTENSIONS.match(n.rsplit("/", 1)[-1])]
        plans: list[ExtensionPlan] = []
    else:
        with steps.step("decide"):
            plans = plan_extensions(stock, decide_inputs(source, arch_cmake, cuda, SM121.target),
                                    {t: p.name for p in projects() for t in p.targets})
            for item in plans:
                note(item.line())
                for why in item.remains:
                    note(f"  {why}")
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
        f"{p.target}: {p.reason}" for p in built) or "no extension gains"
    record.decision = {"rebuild": bool(chosen), "reason": reason, "chosen": list(chosen),
                       "extensions": {p.name: p.as_record() for p in plans}}
    if not chosen:
        record.status = run_report.RunStatus.NOT_NEEDED
        jit = sum(p.after["jit"] for p in plans)
        kept = "; ".join(f"{p.target}: {p.reason}" for p in plans if p.before != p.after
                         or p.before["jit"] or p.before["none"])
        result(f"no rebuild needed: no extension of {opts.base} gains native sm_121 code "
                   f"from a rebuild ({kept or 'every kernel is already native'})"
                   f"{f'; {jit} kernel(s) stay JIT-only' if jit else ''}; nothing tagged; "
                   "--force builds _C/_moe_C anyway, --ext NAME builds NAME")
    return tuple(chosen)


def run_build(pipeline: Pipeline, opts: Options) -> str:
    """Returns the tag; the pipeline's record is filled in as the run goes."""
    record, engine, steps = pipeline.record, pipeline.engine, pipeline.steps
    arch_cmake = cmake_arch_list(opts.arch)
    facts, vllm = pipeline.resolve_image(opts.base, opts.pull)
    if not opts.plan_only:
        pipeline.require_tags_free(facts, [opts.tag], opts.replace_tag)
    ref = version_to_ref(vllm.version, vllm.commit_id)
    require_buildable(vllm.tools, facts.ref)
    cuda = vllm.cuda_version or DEFAULT_CUDA
    with tempfile.TemporaryDirectory(prefix="sm121-build-") as tmp:
        context = Path(tmp)
        with steps.step(f"source ({ref})"):
            changes = ""
            if opts.source:
                state = check_checkout(opts.source, ref, opts.allow_other_commit)
                checkout, commit, changes = state.path, state.commit, state.changes
                if state.other_commit:
                    record.source_other_commit = state.other_commit
                    note(f"warning: {state.other_commit} (--allow-other-commit)")
                if changes:
                    record.source_changes = changes
                    note(f"uncommitted changes in {checkout}: built as they are "
                         f"(sha256 {changes[:12]}, part of the content key)")
            else:
                checkout, commit = fetch_source(ref, opts.repo)
            require_python_headers(vllm.tools, checkout, facts.ref)
            shutil.copytree(checkout, context / "src", ignore=shutil.ignore_patterns(".git"))
            note(f"{checkout} @ {commit}")
        with steps.step("audit the stock extensions"):
            stock = pipeline.read_stock(facts, vllm.extensions)
            too_new = ptx_warning(stock, SM121.target, SM121.driver)
            if too_new:
                note(too_new)
        with steps.step("patch"):
            if opts.no_patch:
                note("patches skipped (--no-patch)")
            else:
                for line in apply_for_build(context / "src", {}, vllm.version, arch_cmake,
                                            cuda, SM121.target):
                    note(line)
        chosen = choose_to_build(pipeline, opts, stock, context / "src", arch_cmake, cuda)
        if not chosen:
            return opts.tag
        if opts.plan_only:
            record.status = run_report.RunStatus.PLANNED
            result(f"plan: build {', '.join(chosen)} for {opts.arch}; nothing built "
                       "(--plan)")
            return opts.tag
        plan = plan_for(facts, opts.arch, chosen, opts.jobs, context / "src", str(ref),
                        commit, buildkit=engine.buildkit_client() is not None,
                        defaults=False)
        projects = projects_for(plan.targets, opts.fa_source)
        provenance = commit + (f"+{changes}" if changes else "")
        if projects:
            with steps.step("external sources"):
                for project in projects:
                    declared = read_pin(context / "src", project)
                    got = copy_into(declared, opts.fa_source, context / project.name,
                                    opts.allow_other_commit)
                    plan = replace(plan, external=(*plan.external,
                                                   (project.env, project.name)))
                    record.external[project.name] = run_report.ExternalSource(
                        got.commit, declared.repository, got.changes, got.other_commit)
                    provenance += f"\0{project.name}@{got.commit}+{got.changes}"
                    if got.other_commit:
                        note(f"warning: {got.other_commit} (--allow-other-commit)")
                    note(f"{project.name} {got.commit[:12]} (pinned in "
                         f"{declared.declared_in}): {got.path}")
                if not opts.no_patch:
                    trees = {folder: context / folder for _env, folder in plan.external}
                    for line in apply_for_build(context / "src", trees, vllm.version,
                                                arch_cmake, cuda, SM121.target, vllm=False):
                        note(line)
        key = content_key(facts, provenance, plan, opts.no_patch)
        record.vllm_commit, record.arch_list, record.content_key = commit, plan.arch_list, key
        record.extensions = list(plan.extensions)
        patches = "none" if opts.no_patch else rules_digest()
        provenance_of_files = Provenance(
            base=facts.ref, base_digest=facts.digest_ref, vllm_version=vllm.version,
            vllm_commit=commit, vllm_commit_id=vllm.commit_id, arch_list=plan.arch_list,
            patches=patches, package_dir=plan.package_dir, tool_version=__version__,
            external={name: entry.commit for name, entry in record.external.items()},
            torch_version=vllm.torch_version)
        also = (versioned_tag(opts.tag, vllm.version, commit, facts.id),) \
            if opts.versioned_tag else ()
        target = Finish(opts.tag, opts.out, provenance_of_files, also, opts.replace_tag, key)
        existing = None if opts.force else pipeline.reusable(key)
        if existing:
            record.keep_audit_of(run_report.recall(key) or {})
            record.status = run_report.RunStatus.UP_TO_DATE
            if opts.out:  # as after a build: the verified files and their manifest
                with steps.step("verify"):
                    pipeline.verify_and_export(facts, existing, plan.extensions, None,
                                               target)
            pipeline.tag_result(facts, existing, target)
            result(f"up to date: {', '.join(target.tags)} (content key {key}); "
                       "--force rebuilds")
            return opts.tag
        log = pipeline.new_log(f"build-{key}")
        with engine.pinned(facts.id) as pin:
            plan = replace(plan, base=pin, labels={**plan.labels, CONTENT_KEY_LABEL: key,
                                                   f"{LABEL_PREFIX}.patches": patches})
            dockerfile = context / "Dockerfile"
            dockerfile.write_text(render(plan))
            if plan.bring:
                note(f"the builder brings {' and '.join(plan.bring)} ("
                     f"{'this machine' if plan.bring_from == 'context' else 'pip'})")
            found = host_tools() if plan.bring_from == "context" else None
            if found:
                place_host_tools(found, plan.bring, context)
            shutil.copy2(Path(__file__).with_name("build_extensions.py"),
                         context / "build_extensions.py")
            pipeline.finish(facts, context, dockerfile, plan.extensions, log,
                            f"build {', '.join(plan.extensions)} for {opts.arch}", target)
    record.status = run_report.RunStatus.BUILT
    run_report.remember(record)
    result(f"tagged {', '.join(target.tags)}  (log: {log})")
    return opts.tag
