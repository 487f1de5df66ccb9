"""The main job: pull -> inspect -> pin -> patch -> decide -> render -> build -> verify -> tag.

Nothing is tagged before verification passes; the temporary build context, the pin tag and
a failed image are removed on any exit, Ctrl-C included.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from sm121_build import __version__
from sm121_build.build.decide import decide
from sm121_build.build.inject import Finish, finish, tag_result, verify_and_export
from sm121_build.build.render import (
    DEFAULT_EXTENSIONS,
    LABEL_PREFIX,
    BuildPlan,
    plan_for,
    render,
    template_digest,
)
from sm121_build.image import ledger
from sm121_build.image.engine import Engine
from sm121_build.image.facts import ImageFacts, cache_dir, inspect_image, require_vllm
from sm121_build.image.refs import versioned_tag
from sm121_build.image.toolchain import host_tools, place_host_tools, require_buildable
from sm121_build.source.external import copy_into, projects_for, read_pin
from sm121_build.source.guards import DEFAULT_CUDA, cmake_arch_list
from sm121_build.source.patch import apply_all, apply_external, rules_digest
from sm121_build.source.pin import check_checkout, fetch_source, version_to_ref
from sm121_build.steps import Progress, Steps, end_status_line, status_line
from sm121_build.verify import run_report
from sm121_build.verify.audit import BinaryReport, audit_binary
from sm121_build.verify.checks import SM121
from sm121_build.verify.fixable import rebuild_verdict

CONTENT_KEY_LABEL = f"{LABEL_PREFIX}.content-key"


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


def content_key(facts: ImageFacts, commit: str, plan: BuildPlan, no_patch: bool) -> str:
    parts = [facts.id, commit, "nopatch" if no_patch else rules_digest(), plan.arch_list,
             template_digest(), ",".join(plan.extensions), __version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def run_build(opts: Options, record: dict[str, Any] | None = None) -> str:
    """Returns the tag; `record` (the run's report) is filled in as the run goes."""
    record = {} if record is None else record
    arch_cmake = cmake_arch_list(opts.arch)
    steps = Steps()
    engine = Engine.connect()
    pull_base(engine, steps, opts.base, opts.pull, record)
    with steps.step(f"inspect {opts.base}"):
        facts = inspect_image(engine, opts.base)
        vllm = require_vllm(facts)
        ref = version_to_ref(vllm.version, vllm.commit_id)
        record.update(vllm_version=vllm.version, base_digest=facts.digest_ref)
        click.echo(f"    vLLM {vllm.version} -> {ref}; {facts.platform}; {facts.digest_ref}",
                   err=True)
        if vllm.tools:
            click.echo(f"    build tools: {vllm.tools.describe()}", err=True)
        require_buildable(vllm.tools, facts.ref)
    with tempfile.TemporaryDirectory(prefix="sm121-build-") as tmp:
        context = Path(tmp)
        with steps.step("source"):
            changes = ""
            if opts.source:
                state = check_checkout(opts.source, ref, opts.allow_other_commit)
                checkout, commit, changes = state.path, state.commit, state.changes
                if state.other_commit:
                    record.update(source_other_commit=state.other_commit)
                    click.echo(f"    warning: {state.other_commit} (--allow-other-commit)",
                               err=True)
                if changes:
                    record.update(source_changes=changes)
                    click.echo(f"    uncommitted changes in {checkout}: built as they are "
                               f"(sha256 {changes[:12]}, part of the content key)", err=True)
            else:
                checkout, commit = fetch_source(ref, opts.repo)
            shutil.copytree(checkout, context / "src", ignore=shutil.ignore_patterns(".git"))
            click.echo(f"    {checkout} @ {commit}", err=True)
        stock: dict[str, BinaryReport | None] = {}
        extra = opts.extra_ext
        if "auto" in extra:
            with steps.step("choose extensions (--ext auto)"):
                stock = read_stock(engine, facts, vllm.extensions)
                verdicts = rebuild_verdicts(stock)
                for name, verdict in verdicts.items():
                    click.echo(f"    {name}: {verdict}", err=True)
                extra = tuple(e for e in extra if e != "auto") + fixable_extensions(verdicts)
        plan = plan_for(facts, opts.arch, extra, opts.jobs, context / "src", str(ref),
                        commit, buildkit=engine.buildkit_client() is not None)
        projects = projects_for(plan.targets, opts.fa_source)
        provenance = commit + (f"+{changes}" if changes else "")
        if projects:
            with steps.step("external sources"):
                for project in projects:
                    declared = read_pin(context / "src", project)
                    got = copy_into(declared, opts.fa_source, context / project.name,
                                    opts.allow_other_commit)
                    plan = BuildPlan(**{**plan.__dict__, "external": (
                        *plan.external, (project.env, project.name))})
                    record.setdefault("external", {})[project.name] = {
                        "commit": got.commit, "repository": declared.repository,
                        **({"changes": got.changes} if got.changes else {}),
                        **({"other_commit": got.other_commit} if got.other_commit else {})}
                    provenance += f"\0{project.name}@{got.commit}+{got.changes}"
                    if got.other_commit:
                        click.echo(f"    warning: {got.other_commit} (--allow-other-commit)",
                                   err=True)
                    click.echo(f"    {project.name} {got.commit[:12]} (pinned in "
                               f"{declared.declared_in}): {got.path}", err=True)
        key = content_key(facts, provenance, plan, opts.no_patch)
        record.update(vllm_commit=commit, arch_list=plan.arch_list, content_key=key,
                      extensions=list(plan.extensions))
        meta = {"base": facts.ref, "base_digest": facts.digest_ref,
                "vllm_version": vllm.version, "vllm_commit": commit,
                "vllm_commit_id": vllm.commit_id, "arch_list": plan.arch_list,
                "patches": "none" if opts.no_patch else rules_digest(),
                "package_dir": plan.package_dir, "tool_version": __version__,
                **({"external": {name: entry["commit"] for name, entry in
                                 record["external"].items()}} if "external" in record else {})}
        also = (versioned_tag(opts.tag, vllm.version, commit, facts.id),) \
            if opts.versioned_tag else ()
        target = Finish(opts.tag, opts.out, meta, record, also)
        existing = engine.find_by_label(CONTENT_KEY_LABEL, key)
        if existing and not opts.force:
            kept = run_report.recall(key) or {}
            record.update({k: kept[k] for k in ("before", "after", "fp4_excluded", "log")
                           if k in kept}, status="up-to-date")
            if opts.out:  # as after a build: the verified files and their manifest
                with steps.step("verify"):
                    verify_and_export(engine, facts, existing[0].id, plan.extensions, None,
                                      target)
            tag_result(engine, facts, existing[0].id, target)
            click.echo(f"up to date: {', '.join(target.tags)} (content key {key}); "
                       "--force rebuilds")
            return opts.tag
        with steps.step("patch"):
            if opts.no_patch:
                click.echo("    patches skipped (--no-patch)", err=True)
            else:
                cuda = vllm.cuda_version or DEFAULT_CUDA
                for result in apply_all(context / "src", vllm.version, arch_cmake,
                                        cuda_version=cuda):
                    click.echo(f"    {result.name}: {result.outcome} ({result.detail})",
                               err=True)
                for _env, folder in plan.external:
                    handed, results = apply_external(context / "src", context / folder, folder,
                                                     vllm.version, arch_cmake, cuda,
                                                     SM121.target)
                    for result in results:
                        click.echo(f"    {result.name} ({folder}, CUDA_ARCHS {handed}): "
                                   f"{result.outcome} ({result.detail})", err=True)
        if not opts.force:
            with steps.step("decide"):
                wanted = {n: stock.get(n) for n in plan.extensions} \
                    if all(n in stock for n in plan.extensions) else \
                    read_stock(engine, facts, plan.extensions)
                decision = decide(wanted, context / "src",
                                  arch_cmake, vllm.cuda_version or DEFAULT_CUDA, SM121.target)
                for line in decision.lines():
                    click.echo(f"    {line}", err=True)
                click.echo(f"    {'rebuild' if decision.rebuild else 'no rebuild'}: "
                           f"{decision.reason}", err=True)
            record["decision"] = decision.as_record()
            if not decision.rebuild:
                record["status"] = "not-needed"
                click.echo(f"no rebuild needed: {opts.base} already runs natively on sm_121 "
                           f"({'; '.join(decision.lines())}); nothing tagged; --force builds "
                           "anyway")
                return opts.tag
        log = cache_dir() / "logs" / f"build-{key}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        record["log"] = str(log)
        with engine.pinned(facts.id) as pin:
            plan = BuildPlan(**{**plan.__dict__, "base": pin,
                                "labels": {**plan.labels, CONTENT_KEY_LABEL: key,
                                           f"{LABEL_PREFIX}.patches": meta["patches"]}})
            dockerfile = context / "Dockerfile"
            dockerfile.write_text(render(plan))
            if plan.bring:
                click.echo(f"    the builder brings {' and '.join(plan.bring)} ("
                           f"{'this machine' if plan.bring_from == 'context' else 'pip'})",
                           err=True)
            found = host_tools() if plan.bring_from == "context" else None
            if found:
                place_host_tools(found, plan.bring, context)
            shutil.copy2(Path(__file__).with_name("build_extensions.py"),
                         context / "build_extensions.py")
            finish(engine, steps, facts, context, dockerfile, plan.extensions, log,
                   f"build {', '.join(plan.extensions)} for {opts.arch}", target)
    record["status"] = "built"
    run_report.remember(record)
    click.echo(f"tagged {', '.join(target.tags)}  (log: {log})")
    return opts.tag


def rebuild_verdicts(stock: dict[str, BinaryReport | None]) -> dict[str, str]:
    """The audit's rebuild verdict of each stock extension that carries device code."""
    return {name: verdict.verdict for name, report in stock.items() if report is not None
            and (verdict := rebuild_verdict(report, SM121.target)) is not None}


def fixable_extensions(verdicts: dict[str, str]) -> tuple[str, ...]:
    """--ext auto: the image's extensions the audit calls fixable (the default ones are
    always built)."""
    return tuple(name for name, verdict in verdicts.items()
                 if verdict == "fixable" and not DEFAULT_EXTENSIONS.match(name))


def read_stock(engine: Engine, facts: ImageFacts,
               extensions: tuple[str, ...]) -> dict[str, BinaryReport | None]:
    """The stock image's copies of the extensions a build would replace, audited."""
    package = require_vllm(facts).package_dir
    reports: dict[str, BinaryReport | None] = {}
    progress = Progress("reading the stock extensions")
    with tempfile.TemporaryDirectory(prefix="sm121-decide-") as tmp, \
            engine.reader(facts.id, progress.add) as files:
        for name in extensions:
            local = Path(tmp) / name
            found = files.copy_file(f"{package}/{name}", local)
            reports[name] = audit_binary(local, name, SM121, with_kernels=True) if found \
                else None
            local.unlink(missing_ok=True)
    progress.done()
    return reports


def pull_base(engine: Engine, steps: Steps, base: str, mode: str,
              record: dict[str, Any]) -> None:
    """`--pull` (always) or `--pull=missing`: bring the base from its registry first.  A tag
    that moved leaves the old image behind; the ledger notes it for `sm121-build prune`."""
    if mode == "never" or (mode == "missing" and engine.exists(base)):
        return
    with steps.step(f"pull {base}"):
        before = engine.image_id(base)
        after = engine.pull(base, status_line)
        end_status_line()
        record["pulled"] = {"before": before, "after": after}
        short = after.split(":")[-1][:12]
        if before is None:
            line = f"new image {short}"
        elif before == after:
            line = f"unchanged, {short}"
        else:
            ledger.record_replaced(base, before)
            line = f"new image {short} (was {before.split(':')[-1][:12]})"
        click.echo(f"    {base}: {line}", err=True)
