"""The labels this tool writes on the images it makes (a bottom-layer vocabulary: every
stage that reads or writes them imports it from here)."""

from __future__ import annotations

LABEL_PREFIX = "io.github.sm121-build"
CONTENT_KEY_LABEL = f"{LABEL_PREFIX}.content-key"
REUSE_KEY_LABEL = f"{LABEL_PREFIX}.reuse-key"
KIND_LABEL = f"{LABEL_PREFIX}.kind"
# One table, field of the manifest/provenance -> the label that carries it on an image: every
# writer (built images: `jobs/render.provenance_labels`; kernels images:
# `jobs/kernels_image._labels`) and reader takes the names from here.
FIELD_LABELS: dict[str, str] = {
    "base": "org.opencontainers.image.base.name",
    "base_digest": "org.opencontainers.image.base.digest",
    "vllm_version": f"{LABEL_PREFIX}.vllm.version",
    "vllm_commit": f"{LABEL_PREFIX}.vllm.commit",
    "vllm_commit_id": f"{LABEL_PREFIX}.vllm.commit-id",
    "torch_version": f"{LABEL_PREFIX}.torch.version",
    "patches": f"{LABEL_PREFIX}.patches",
    "arch_list": f"{LABEL_PREFIX}.arch-list",
    "extensions": f"{LABEL_PREFIX}.extensions",
    "tool_version": f"{LABEL_PREFIX}.tool-version",
    "gpu": f"{LABEL_PREFIX}.gpu",  # the GPU the files are native on (--gpu): `sm_121`
    # the files aot made beside a source build (`extensions` names the files built); an
    # aot-only image names its files in `extensions`
    "aot": f"{LABEL_PREFIX}.aot",
}
# The OCI annotations for the base image, which the tool sets too (they name the stock
# image the result was made from, replacing whatever the stock image said of its own base).
OCI_BASE_LABELS = ("org.opencontainers.image.base.name", "org.opencontainers.image.base.digest")


def is_ours(key: str) -> bool:
    """A label the tool sets: any other label of a stock image must reach the result as is."""
    return key.startswith(f"{LABEL_PREFIX}.") or key in OCI_BASE_LABELS


def foreign(labels: dict[str, str]) -> dict[str, str]:
    """The labels the tool does not set."""
    return {k: v for k, v in labels.items() if not is_ours(k)}


def made_by_us(labels: dict[str, str]) -> bool:
    return any(k.startswith(f"{LABEL_PREFIX}.") for k in labels)
