"""`sm121-build dockerfile --base IMAGE`: print the rendered Dockerfile for plain docker build."""

from __future__ import annotations

from dataclasses import replace

import click

from sm121_build.cli.params import arch_option, extension_option, gpu_option, jobs_option
from sm121_build.core.console import notice, say
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.binary import Policy
from sm121_build.cuda.compat import DEFAULT_GPU, ArchList
from sm121_build.image.build_tools import require_buildable
from sm121_build.image.refs import IMAGE_ID
from sm121_build.jobs.formats.render import LayoutRequest, layout_for, render_build
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.source.git_pin import version_to_ref


@click.command()
@click.option("--base", required=True, help="Stock vLLM image in the local engine.")
@gpu_option()
@arch_option("TORCH_CUDA_ARCH_LIST.")
@extension_option("Another extension to rebuild.")
@jobs_option()
@click.option("--no-buildkit", is_flag=True, help="No RUN --mount cache (legacy builder).")
def dockerfile(base: str, gpu: Policy, arch: ArchList,  # noqa: PLR0913 (click options)
               extra_ext: tuple[str, ...], jobs: int | None, no_buildkit: bool) -> None:
    """Print the multi-stage Dockerfile; the build context needs src/ and build_extensions.py.

    cmake or ninja the image lacks are pip-installed in the builder stage (network).  A
    source build is for sm_121 (the guard rules are written for it): another --gpu is
    refused, and `sm121-build aot IMAGE --gpu GPU` serves it."""
    if not gpu.has_source_rules:
        raise Sm121Error(f"--gpu {gpu}: the Dockerfile builds from source, which is for "
                         f"{DEFAULT_GPU} only (the guard rules are written for it); "
                         f"`sm121-build aot IMAGE --gpu {gpu}` serves {gpu}")
    facts, vllm = Pipeline.connect().resolve_image(base)
    ref = version_to_ref(vllm.version, vllm.commit_id)
    require_buildable(vllm.tools, facts.ref)
    layout = layout_for(facts, LayoutRequest(arch, extra_ext, str(ref), not no_buildkit, jobs,
                                       copy_tools=False))
    if layout.base == facts.id:
        # No registry digest to pin: `FROM sha256:<id>` sends BuildKit to Docker Hub, so
        # the Dockerfile names the image as the user did (a tag both builders resolve here).
        if IMAGE_ID.match(base):
            raise Sm121Error(f"{base} is an image ID and the image has no registry digest: a "
                             "Dockerfile cannot name it offline; pass one of its tags")
        layout = replace(layout, base=base)
        notice(f"note: {base} has no registry digest; FROM names the tag, not pinned to "
               f"{facts.id[:19]}")
    say(render_build(layout), nl=False)
