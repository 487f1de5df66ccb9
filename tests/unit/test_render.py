"""Rendering the Dockerfile: golden files, no syntax directive, paths from the layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sm121_build import __version__
from sm121_build.core.errors import Sm121Error
from sm121_build.core.vllm import extension_target
from sm121_build.jobs.formats.artifacts import Manifest
from sm121_build.jobs.formats.render import (
    BuildLayout,
    choose_extensions,
    render_build,
    render_kernels,
)
from sm121_build.source.external import source_targets

GOLDEN = Path(__file__).resolve().parent.parent / "golden"

PLAN = BuildLayout(
    base="vllm/vllm-openai@sha256:" + "ab" * 32,
    arch_list="12.1",
    vllm_version="0.19.1",
    git_ref="tag v0.19.1",
    extensions=("_C.abi3.so", "_moe_C.abi3.so"),
    package_dir="/usr/local/lib/python3.12/dist-packages/vllm",
    cuda_home="/usr/local/cuda",
    cuda_include="/usr/local/lib/python3.12/dist-packages/nvidia/cu13/include",
    cuda_lib="/usr/local/lib/python3.12/dist-packages/nvidia/cu13/lib",
    jobs=8,
    nvrtc_fix=True,
    labels={"io.github.sm121-build.vllm.version": "0.19.1",
            "org.opencontainers.image.base.digest": "vllm/vllm-openai@sha256:" + "ab" * 32},
)


@pytest.mark.parametrize(("name", "layout"), [
    ("buildkit.Dockerfile", PLAN),
    ("legacy-stable-libtorch.Dockerfile", BuildLayout(**{
        **PLAN.__dict__, "buildkit": False, "nvrtc_fix": False,
        "extensions": ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"),
        "package_dir": "/opt/venv/lib/python3.11/site-packages/vllm",
        "bring": ("cmake",), "bring_from": "context"})),
    ("pip-tools.Dockerfile", BuildLayout(**{**PLAN.__dict__, "bring": ("cmake", "ninja"),
                                          "bring_from": "pip"})),
    ("flash-attn.Dockerfile", BuildLayout(**{
        **PLAN.__dict__, "extensions": (*PLAN.extensions, "vllm_flash_attn/_vllm_fa2_C.abi3.so"),
        "external": (("VLLM_FLASH_ATTN_SRC_DIR", "vllm-flash-attn"),)})),
])
def test_golden(name: str, layout: BuildLayout) -> None:
    text = render_build(layout).replace(__version__, "<VERSION>")
    _compare_golden(GOLDEN / name, text)
    assert "syntax" not in text.splitlines()[0]


def _compare_golden(golden: Path, text: str) -> None:
    """SM121_UPDATE_GOLDEN=1 rewrites the file and fails: a rewrite is never a pass."""
    if os.environ.get("SM121_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
        pytest.fail(f"{golden.name} rewritten; review the diff and run again without "
                    "SM121_UPDATE_GOLDEN")
    assert text == golden.read_text()


def test_golden_kernels_image() -> None:
    """The kernels image: FROM scratch, the root folder, the labels (quoted, sorted)."""
    from sm121_build.jobs.kernel_images.kernels_image import _labels

    manifest = {"base_digest": "vllm/vllm-openai@sha256:" + "ab" * 32,
                "vllm_version": "0.19.1", "vllm_commit": "v0.19.1", "arch_list": "12.1",
                "torch_version": "2.11.0+cu130", "patches": "0123456789abcdef",
                "files": {"_C.abi3.so": {}, "_moe_C.abi3.so": {}}}
    text = render_kernels(_labels(Manifest.from_json(manifest))).replace(__version__, "<VERSION>")
    _compare_golden(GOLDEN / "kernels.Dockerfile", text)


def test_tools_stay_in_the_builder_stage() -> None:
    """cmake/ninja the image lacks are added before the compile, and never after the
    final stage's FROM."""
    for bring_from, marker in (("context", "COPY tools/"), ("pip", "pip install")):
        text = render_build(BuildLayout(**{**PLAN.__dict__, "bring": ("cmake",),
                                   "bring_from": bring_from}))
        final = text.rindex("\nFROM ")
        assert marker in text[:final] and marker not in text[final:]
        assert text.index(marker) < text.index("build_extensions.py --source")
        assert '"cmake>=3.26"' in text or bring_from == "context"


def test_targets_from_extension_names() -> None:
    assert extension_target("_C.abi3.so") == "_C"
    assert extension_target("_moe_C_stable_libtorch.abi3.so") == "_moe_C_stable_libtorch"
    assert extension_target("_C.cpython-312-aarch64-linux-gnu.so") == "_C"


def test_default_extensions_follow_the_image(tmp_path: Path) -> None:
    image = ("_C.abi3.so", "_flashmla_C.abi3.so", "_moe_C.abi3.so", "cumem_allocator.abi3.so")
    assert choose_extensions(image, (), None) == ("_C.abi3.so", "_moe_C.abi3.so")
    newer = ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so")
    assert choose_extensions(newer, (), None) == newer
    assert choose_extensions(image, ("_flashmla_C",), None)[-1] == "_flashmla_C.abi3.so"
    (tmp_path / "CMakeLists.txt").write_text("define_gpu_extension_target(\n  _C\n)\n")
    with pytest.raises(Sm121Error, match=r"no CMake target for _moe_C\.abi3\.so"):
        choose_extensions(image, (), frozenset(source_targets(tmp_path)))
    with pytest.raises(Sm121Error, match="no _C / _moe_C"):
        choose_extensions(("cumem_allocator.abi3.so",), (), None)


def test_inject_golden() -> None:
    from sm121_build.jobs.formats.render import render_inject

    text = render_inject(PLAN).replace(__version__, "<VERSION>")
    _compare_golden(GOLDEN / "inject-artifacts.Dockerfile", text)
    assert [line for line in text.splitlines() if line.startswith(("FROM", "RUN"))] == [
        f"FROM {PLAN.base}"]  # one stage, nothing compiled


def test_flash_attention_names_resolve_to_the_images_path() -> None:
    image = ("_C.abi3.so", "_moe_C.abi3.so", "vllm_flash_attn/_vllm_fa2_C.abi3.so",
             "vllm_flash_attn/_vllm_fa3_C.abi3.so")
    fa2 = "vllm_flash_attn/_vllm_fa2_C.abi3.so"
    for name in ("_vllm_fa2_C", "_vllm_fa2_C.abi3.so"):
        assert choose_extensions(image, (name,), None) == ("_C.abi3.so", "_moe_C.abi3.so", fa2)
    # an image without it: the place vLLM installs it
    assert choose_extensions(image[:2], ("_vllm_fa2_C",), None)[-1] == fa2
    assert extension_target(fa2) == "_vllm_fa2_C"


@pytest.mark.parametrize("path", ["/opt/a\nRUN touch /pwned #/vllm/_C.abi3.so",
                                  "/opt/a b/vllm/_C.abi3.so", "/opt/x\x1b]0;y\x07/vllm/_C.so",
                                  "/opt/../etc/vllm/_C.so", "relative/vllm/_C.so"])
def test_a_path_that_is_not_plain_never_reaches_a_dockerfile(path: str) -> None:
    """Red team 3: an image's ENTRYPOINT interpreter path with a newline became a RUN line
    of the Dockerfile `inject` built (and `dockerfile` printed); a space split the COPY."""
    from sm121_build.core.errors import Sm121Error
    from sm121_build.image.facts import plain_path
    from sm121_build.jobs.formats.render import _require_plain

    with pytest.raises(Sm121Error, match="not a plain absolute path"):
        _require_plain(path)
    assert not plain_path(path.rsplit("/vllm/", 1)[0])
    _require_plain("/usr/local/lib/python3.12/dist-packages/vllm/_C.abi3.so")


def test_a_cuda_home_that_is_not_plain_never_reaches_a_dockerfile() -> None:
    """Red team 4: an image's `ENV CUDA_HOME="/opt/cu X=1 LD_PRELOAD=evil.so"` (with an nvcc
    there) became words of the builder stage's ENV: the facts pass it over, and the
    renderer refuses one that would reach it."""
    from sm121_build.core.errors import Sm121Error
    from sm121_build.image.facts import plain_path
    from sm121_build.jobs.formats.render import _require_plain

    for home in ("/opt/cu X=1 LD_PRELOAD=evil.so", "/opt/cu\nRUN id", "/opt/a b"):
        assert not plain_path(home)
        with pytest.raises(Sm121Error, match="not a plain absolute path"):
            _require_plain(f"{home}/include")
    assert plain_path("/usr/local/cuda-13.0")
