"""Fixtures the whole-run unit tests share (the pipeline on the FAKE engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.stockimage import fixture_checkout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The vLLM-shaped source in a real git repository: (path, commit)."""
    return fixture_checkout(tmp_path_factory.mktemp("src") / "vllm")


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tool's cache for this test only."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
