"""The main job: inspect -> pin -> patch -> render -> build -> verify -> tag -> export.

Nothing is tagged before verification passes; the temporary build context and a failed
image are removed on any exit, Ctrl-C included.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

from . import __version__
from .audit import Policy, audit_binary
from .compat import parse_target
from .engine import Engine, build_image
from .errors import VerificationError
from .explain import cmake_arch_list
from .inspect import ImageFacts, cache_dir, inspect_image, require_vllm
from .patch import apply_all, sets_digest
from .pin import fetch_source, resolve_checkout, version_to_ref
from .render import LABEL_PREFIX, BuildPlan, plan_for, render, template_digest
from .sources import binaries

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


class Steps:
    """Timed steps; folded into groups on GitHub Actions (like cibuildwheel's logger)."""

    def __init__(self) -> None:
        self.actions = os.environ.get("GITHUB_ACTIONS") == "true"

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        start = time.monotonic()
        click.echo(f"::group::{title}" if self.actions else f"==> {title}", err=True)
        try:
            yield
        finally:
            if self.actions:
                click.echo("::endgroup::", err=True)
            click.echo(f"    {title}: {time.monotonic() - start:.1f}s", err=True)


def content_key(facts: ImageFacts, commit: str, plan: BuildPlan, no_patch: bool) -> str:
    parts = [facts.id, commit, "nopatch" if no_patch else sets_digest(), plan.arch_list,
             template_digest(), ",".join(plan.extensions), __version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _status_line(text: str) -> None:
    if sys.stderr.isatty():
        click.echo(f"\r\033[K    {text[:110]}", nl=False, err=True)


def run_build(opts: Options) -> str:
    arch_cmake = cmake_arch_list(opts.arch)
    steps = Steps()
    engine = Engine.connect()
    with steps.step(f"inspect {opts.base}"):
        facts = inspect_image(engine, opts.base)
        vllm = require_vllm(facts)
        ref = version_to_ref(vllm.version, vllm.commit_id)
        click.echo(f"    vLLM {vllm.version} -> {ref}; {facts.platform}; {facts.digest_ref}",
                   err=True)
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
        existing = engine.find_by_label(CONTENT_KEY_LABEL, key)
        if existing and not opts.force:
            if not engine.exists(opts.tag):
                engine.tag(existing[0].id, opts.tag)
            click.echo(f"up to date: {opts.tag} (content key {key}); --force rebuilds")
            return opts.tag
        with steps.step("patch"):
            if opts.no_patch:
                click.echo("    patches skipped (--no-patch)", err=True)
            else:
                for result in apply_all(context / "src", vllm.version, arch_cmake):
                    click.echo(f"    {result.name}: {result.outcome} ({result.detail})",
                               err=True)
        plan = BuildPlan(**{**plan.__dict__,
                            "labels": {**plan.labels, CONTENT_KEY_LABEL: key}})
        dockerfile = context / "Dockerfile"
        dockerfile.write_text(render(plan))
        shutil.copy2(Path(__file__).with_name("build_extensions.py"),
                     context / "build_extensions.py")
        log = cache_dir() / "logs" / f"build-{key}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        image_id = ""
        try:
            with steps.step(f"build {', '.join(plan.extensions)} for {opts.arch}"):
                image_id = build_image(engine, context, dockerfile, log, _status_line)
            with steps.step("verify"):
                verify(engine, facts, image_id, plan, opts.out, log)
            engine.tag(image_id, opts.tag)
        except BaseException:
            if image_id:
                engine.remove_image(image_id)
            raise
        finally:
            if sys.stderr.isatty():
                click.echo("", err=True)
    click.echo(f"tagged {opts.tag}  (log: {log})")
    return opts.tag


def verify(engine: Engine, stock: ImageFacts, image_id: str, plan: BuildPlan,
           out: Path | None, log: Path) -> None:
    """Cubins and version checks on the built image; exports artifacts when asked."""
    built = inspect_image(engine, image_id)
    built_vllm = require_vllm(built)
    stock_vllm = require_vllm(stock)
    if (built_vllm.version, built_vllm.commit_id) != (stock_vllm.version, stock_vllm.commit_id):
        raise VerificationError(
            f"vLLM in the built image is {built_vllm.version} ({built_vllm.commit_id}), the stock "
            f"image has {stock_vllm.version} ({stock_vllm.commit_id}); not tagged")
    policy = Policy(parse_target("sm_121"), (13, 0))
    wanted = tuple(f"{plan.package_dir.lstrip('/')}/{e}" for e in plan.extensions)
    manifest: dict[str, object] = {
        "base": stock.ref, "base_digest": stock.digest_ref, "vllm_version": stock_vllm.version,
        "vllm_commit": plan.labels.get(f"{LABEL_PREFIX}.vllm.commit"),
        "arch_list": plan.arch_list, "tool_version": __version__, "files": {}}
    with binaries(image_id, include=wanted, platform=built.platform) as found:
        names = {b.path.name for b in found}
        missing = [e for e in plan.extensions if e not in names]
        if missing:
            raise VerificationError(f"built image lacks {', '.join(missing)}; not tagged")
        for binary in found:
            report = audit_binary(binary.path, binary.name, policy, with_kernels=True)
            counts = report.kernel_counts()
            click.echo(f"    {binary.path.name}: {report.arch_counts('elf')}, "
                       f"{counts['native']} kernels native on sm_121", err=True)
            if counts["native"] == 0:
                raise VerificationError(
                    f"{binary.path.name} carries no sm_121-loadable cubin; not tagged "
                    f"(log: {log})")
            files = manifest["files"]
            assert isinstance(files, dict)
            files[binary.path.name] = {
                "sha256": hashlib.sha256(binary.path.read_bytes()).hexdigest(),
                "cubins": report.arch_counts("elf"), "kernels_native_sm121": counts["native"]}
            if out:
                out.mkdir(parents=True, exist_ok=True)
                shutil.copy2(binary.path, out / binary.path.name)
    if out:
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
