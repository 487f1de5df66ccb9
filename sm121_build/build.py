"""The main job: inspect -> pin -> patch -> render -> build -> inject -> verify -> tag.

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

from . import __version__, run_report
from .engine import Engine
from .explain import DEFAULT_CUDA, cmake_arch_list
from .inject import Finish, finish
from .inspect import ImageFacts, cache_dir, inspect_image, require_vllm
from .patch import apply_all, sets_digest
from .pin import fetch_source, resolve_checkout, version_to_ref
from .render import LABEL_PREFIX, BuildPlan, plan_for, render, template_digest
from .steps import Steps
from .toolchain import host_tools, place_host_tools, require_buildable

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


def content_key(facts: ImageFacts, commit: str, plan: BuildPlan, no_patch: bool) -> str:
    parts = [facts.id, commit, "nopatch" if no_patch else sets_digest(), plan.arch_list,
             template_digest(), ",".join(plan.extensions), __version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def run_build(opts: Options, record: dict[str, Any] | None = None) -> str:
    """Returns the tag; `record` (the run's report) is filled in as the run goes."""
    record = {} if record is None else record
    arch_cmake = cmake_arch_list(opts.arch)
    steps = Steps()
    engine = Engine.connect()
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
            if opts.source:
                checkout, commit = opts.source, resolve_checkout(opts.source)
            else:
                checkout, commit = fetch_source(ref, opts.repo)
            shutil.copytree(checkout, context / "src", ignore=shutil.ignore_patterns(".git"))
            click.echo(f"    {checkout} @ {commit}", err=True)
        plan = plan_for(facts, opts.arch, opts.extra_ext, opts.jobs, context / "src", str(ref),
                        commit, buildkit=engine.buildkit_client() is not None)
        key = content_key(facts, commit, plan, opts.no_patch)
        record.update(vllm_commit=commit, arch_list=plan.arch_list, content_key=key,
                      extensions=list(plan.extensions))
        existing = engine.find_by_label(CONTENT_KEY_LABEL, key)
        if existing and not opts.force:
            if not engine.exists(opts.tag):
                engine.tag(existing[0].id, opts.tag)
            kept = run_report.recall(key) or {}
            record.update({k: kept[k] for k in ("before", "after", "fp4_excluded", "log")
                           if k in kept}, status="up-to-date", image_id=existing[0].id)
            click.echo(f"up to date: {opts.tag} (content key {key}); --force rebuilds")
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
        log = cache_dir() / "logs" / f"build-{key}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        record["log"] = str(log)
        meta = {"base": facts.ref, "base_digest": facts.digest_ref,
                "vllm_version": vllm.version, "vllm_commit": commit,
                "vllm_commit_id": vllm.commit_id, "arch_list": plan.arch_list,
                "patches": "none" if opts.no_patch else sets_digest(),
                "package_dir": plan.package_dir, "tool_version": __version__}
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
                   f"build {', '.join(plan.extensions)} for {opts.arch}",
                   Finish(opts.tag, opts.out, meta, record))
    record["status"] = "built"
    run_report.remember(record)
    click.echo(f"tagged {opts.tag}  (log: {log})")
    return opts.tag
