"""The labels this tool writes on the images it makes (a bottom-layer vocabulary: every
stage that reads or writes them imports it from here)."""

from __future__ import annotations

LABEL_PREFIX = "io.github.sm121-build"
CONTENT_KEY_LABEL = f"{LABEL_PREFIX}.content-key"
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
