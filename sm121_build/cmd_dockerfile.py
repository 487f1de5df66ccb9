"""`sm121-build dockerfile --base IMAGE`: print the rendered Dockerfile for plain docker build."""

from __future__ import annotations

import click

from .engine import Engine
from .guards import cmake_arch_list
from .inspect import inspect_image, require_vllm
from .pin import version_to_ref
from .render import plan_for, render


@click.command()
@click.option("--base", required=True, help="Stock vLLM image in the local engine.")
@click.option("--arch", default="12.1", show_default=True, help="TORCH_CUDA_ARCH_LIST.")
@click.option("--ext", "extra_ext", multiple=True, help="Another extension to rebuild.")
@click.option("--jobs", type=int, help="MAX_JOBS (default: from cores and memory).")
@click.option("--no-buildkit", is_flag=True, help="No RUN --mount cache (legacy builder).")
def dockerfile(base: str, arch: str, extra_ext: tuple[str, ...], jobs: int | None,
               no_buildkit: bool) -> None:
    """Print the multi-stage Dockerfile; the build context needs src/ and build_extensions.py.

    cmake or ninja the image lacks are pip-installed in the builder stage (network)."""
    cmake_arch_list(arch)
    facts = inspect_image(Engine.connect(), base)
    vllm = require_vllm(facts)
    ref = version_to_ref(vllm.version, vllm.commit_id)
    plan = plan_for(facts, arch, extra_ext, jobs, None, str(ref), None, not no_buildkit,
                    copy_tools=False)
    click.echo(render(plan), nl=False)
