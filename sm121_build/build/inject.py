"""Put built extension files into the pristine base image, verify, then tag.

Two ways in: the main job's multi-stage build (compile + copy, from build.py) and
`sm121-build inject --artifacts DIR` (copy prebuilt files, no compile step).  Both end in
`finish`: build the image untagged, verify it, export artifacts, tag it; on any failure,
Ctrl-C included, nothing is tagged and the image is removed if this run created it (never
an image that existed before, such as a build-cache hit the user has tagged).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from sm121_build.build import artifacts as artifacts_mod
from sm121_build.build.render import BuildPlan, provenance_labels, render_inject
from sm121_build.errors import Sm121Error
from sm121_build.image import ledger
from sm121_build.image.engine import Engine, build_image
from sm121_build.image.facts import ImageFacts, cache_dir, inspect_image, require_vllm
from sm121_build.steps import Steps, status_line
from sm121_build.verify import run_report
from sm121_build.verify.checks import Verified, verify_image


@dataclass(frozen=True)
class Finish:
    tag: str
    out: Path | None
    meta: dict[str, Any]  # manifest fields besides files
    record: dict[str, Any] = field(default_factory=dict)  # the run's report, filled in here
    also: tuple[str, ...] = ()  # more tags for the same image (e.g. the immutable one)

    @property
    def tags(self) -> list[str]:
        return list(dict.fromkeys((self.tag, *self.also)))


def _details(verified: Verified) -> dict[str, dict[str, Any]]:
    return {name: {"cubins": report.arch_counts("elf"),
                   "kernels_native_sm121": report.kernel_counts()["native"]}
            for name, report in verified.reports.items()}


def finish(engine: Engine, steps: Steps, stock: ImageFacts, context: Path, dockerfile: Path,
           extensions: tuple[str, ...], log: Path, title: str, target: Finish) -> str:
    """Build (untagged) -> verify -> export -> tag.  Returns the image ID."""
    image_id = ""
    before = engine.image_ids()
    try:
        with steps.step(title):
            image_id = build_image(engine, context, dockerfile, log, status_line)
        with steps.step("verify"):
            verify_and_export(engine, stock, image_id, extensions, log, target)
        tag_result(engine, stock, image_id, target)
    except BaseException:
        if image_id:
            engine.remove_created(image_id, before)
        raise
    return image_id


def verify_and_export(engine: Engine, stock: ImageFacts, image_id: str,
                      extensions: tuple[str, ...], log: Path | None, target: Finish) -> None:
    """Verify the image (raises on any problem); record the audit; export to `--out`."""
    with verify_image(engine, stock, image_id, extensions, log) as verified:
        target.record.update(
            before=run_report.binaries(verified.stock_reports),
            after=run_report.binaries(verified.reports),
            fp4_excluded={n: len(c.fp4_excluded) for n, c in verified.comparisons.items()},
            abi_symbols_checked=verified.abi.checked)
        if target.out:
            manifest = artifacts_mod.export(target.out, verified.files, target.meta,
                                            _details(verified))
            target.record["artifacts"] = str(target.out)
            click.echo(f"    artifacts: {manifest}", err=True)


def tag_result(engine: Engine, stock: ImageFacts, image_id: str, target: Finish) -> None:
    """Give the verified image every tag asked for, and write it in the ledger (for prune)."""
    for tag in target.tags:
        engine.tag(image_id, tag)
    target.record.update(image_id=image_id, tags=target.tags)
    ledger.record_built(image_id, target.tags, stock.id)


def run_inject(folder: Path, base: str, tag: str, out: Path | None = None,
               record: dict[str, Any] | None = None) -> str:
    """Inject prebuilt artifacts into a base whose vLLM version and commit match them."""
    record = {} if record is None else record
    found = artifacts_mod.load(folder)
    record.update(vllm_version=found.version, vllm_commit=found.commit,
                  arch_list=str(found.manifest["arch_list"]))
    steps = Steps()
    engine = Engine.connect()
    with steps.step(f"inspect {base}"):
        facts = inspect_image(engine, base)
        vllm = require_vllm(facts)
    if (vllm.version, vllm.commit_id or "") != (found.version, found.manifest.get(
            "vllm_commit_id") or ""):
        raise Sm121Error(
            f"artifacts in {folder} were built for vLLM {found.version} "
            f"({found.manifest.get('vllm_commit_id') or 'no commit id'}); {base} has "
            f"{vllm.version} ({vllm.commit_id or 'no commit id'}): refusing to inject")
    extensions = tuple(sorted(found.files))
    meta = {key: value for key, value in found.manifest.items() if key not in ("files",
                                                                               "format")}
    with tempfile.TemporaryDirectory(prefix="sm121-inject-") as tmp, \
            engine.pinned(facts.id) as pin:
        context = Path(tmp)
        found.place(context / "artifacts")
        labels = provenance_labels(facts, found.commit, str(found.manifest["arch_list"]),
                                   extensions, str(found.manifest.get("patches", "")))
        plan = BuildPlan(base=pin, arch_list=str(found.manifest["arch_list"]),
                         vllm_version=vllm.version, git_ref=found.commit,
                         extensions=extensions, package_dir=vllm.package_dir,
                         cuda_home="", cuda_include="", cuda_lib="", jobs=1, labels=labels)
        dockerfile = context / "Dockerfile"
        dockerfile.write_text(render_inject(plan))
        log = cache_dir() / "logs" / f"inject-{facts.id.split(':')[-1][:12]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        record.update(base_digest=facts.digest_ref, log=str(log))
        finish(engine, steps, facts, context, dockerfile, extensions, log,
               f"inject {', '.join(extensions)}",
               Finish(tag, out, {**meta, "base": facts.ref, "base_digest": facts.digest_ref},
                      record))
    record["status"] = "injected"
    click.echo(f"tagged {tag}  (log: {log})")
    return tag
