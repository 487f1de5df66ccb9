"""`sm121-build inject --artifacts DIR`: prebuilt files into the pristine base, no compile.

The pipeline's prelude and tail with a one-stage Dockerfile between them; refuses artifacts
built for another vLLM version or commit.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, replace
from pathlib import Path

from sm121_build.core.errors import Sm121Error
from sm121_build.core.interrupts import temp_dir
from sm121_build.jobs.formats import artifacts as artifacts_mod
from sm121_build.jobs.formats.render import (
    Placement,
    gpu_label,
    provenance_labels,
    render_inject,
)
from sm121_build.jobs.framework.pipeline import Delivery, ImageBuild, Pipeline, say_tagged
from sm121_build.jobs.framework.run_record import RunStatus
from sm121_build.jobs.kernel_images.kernels_image import gpu_refusal, refusal


def require_known_paths(files: tuple[str, ...], extensions: tuple[str, ...], folder: Path,
                        base: str) -> None:
    """What may be placed is exactly what the base has: a file at a path where the base has
    no extension (`vllm/_version.abi3.so` would be imported before `_version.py`, running its
    code at every `import vllm`) is refused, naming it, before anything is built or tagged."""
    unknown = sorted(set(files) - set(extensions))
    if unknown:
        raise Sm121Error(f"artifacts in {folder} would place {unknown[0]}"
                         f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}, "
                         f"which {base} has no extension file at: only the base's own "
                         "extension files are replaced; refusing to inject")


def stock_modes(pipeline: Pipeline, image_id: str, package_dir: str, folder: Path,
                files: tuple[str, ...]) -> None:
    """Give each file to be placed the mode of the stock file it replaces (COPY keeps the
    context's mode): a placed file never changes who may run or write it."""
    with pipeline.engine.reader(image_id) as image:
        for name in files:
            found = image.stat(posixpath.join(package_dir, name))
            if found is not None:
                (folder / name).chmod(found.mode & 0o7777)


@dataclass(frozen=True)
class Destination:
    """Where an injection goes: the tag, an --out folder, and whether the tag may move off
    an image this tool did not build (--replace-tag)."""

    tag: str
    out: Path | None = None
    replace_tag: bool = False


def run_inject(pipeline: Pipeline, found: artifacts_mod.Artifacts, base: str,
               dest: Destination) -> str:
    """Inject checked artifacts into a base whose vLLM version and commit match them, and
    whose torch does (where the manifest names the torch they were built against)."""
    record = pipeline.record
    folder, tag, out, replace_tag = found.folder, dest.tag, dest.out, dest.replace_tag
    built = found.provenance
    arch_list = built.arch_list
    record.build_named(built.vllm_version, built.vllm_commit, built.archs)
    facts, vllm = pipeline.resolve_image(base)
    pipeline.require_tags_free(facts, [tag], replace_tag)
    why = refusal(built, vllm, base, facts.platform) or gpu_refusal(built, pipeline.gpu)
    if why:
        raise Sm121Error(f"artifacts in {folder} {why.what}: refusing to inject{why.hint}")
    require_known_paths(tuple(found.files), vllm.extensions, folder, base)
    extensions = tuple(sorted(found.files))
    with temp_dir("sm121-inject-") as tmp, \
            pipeline.engine.pinned(facts.id) as pin:
        context = Path(tmp)
        found.place(context / "artifacts")
        stock_modes(pipeline, facts.id, vllm.package_dir, context / "artifacts", extensions)
        labels = provenance_labels(facts, built.vllm_commit, built.archs,
                                   extensions, built.patches) | gpu_label(built.served)
        placement = Placement(pin, arch_list, vllm.version, built.vllm_commit, extensions,
                              vllm.package_dir, labels)
        dockerfile = context / "Dockerfile"
        dockerfile.write_text(render_inject(placement))
        log = pipeline.new_log(f"inject-{facts.id.split(':')[-1][:12]}")
        delivery = Delivery(tag, out, replace(built, base=facts.ref,
                                              base_digest=facts.digest_ref,
                                              platform=facts.platform, gpu=built.served),
                            replace_tag=replace_tag,
                            origins=tuple((name, "placed") for name in extensions))
        pipeline.build_verify_tag(
            ImageBuild(facts, context, dockerfile, extensions, log,
                       f"inject {', '.join(extensions)}"), delivery)
    record.ended(RunStatus.INJECTED)
    say_tagged(delivery, log)
    return tag
