"""The suite's own scheduling (tests/conftest.py): under pytest-xdist the engine's tests are
one unit on one worker, and a test not marked `docker` has no engine to reach."""

from __future__ import annotations

import os
from pathlib import Path

import docker
import pytest

from tests.conftest import ENGINE, EngineApart, _engine_file

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_that_marks_a_test_docker_is_one_unit_the_rest_each_their_own() -> None:
    """Every test file spelling `pytest.mark.docker` is the engine's (a unit file is not);
    its tests, parametrized or not, share one scope; any other test is a scope alone."""
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                    if "pytest.mark.docker" in p.read_text())
    assert "tests/integration/test_e2e_docker.py" in marked
    assert "tests/integration/test_build_errors.py" in marked  # one test marked, not the file
    assert all(_engine_file(path) for path in marked)
    assert not _engine_file("tests/unit/test_pipeline.py")
    split = EngineApart._split_scope
    assert split(None, "tests/integration/test_e2e_docker.py::test_x[ctrl_c]") == ENGINE
    assert split(None, "tests/integration/test_build_errors.py::test_engine_not_running") \
        == ENGINE
    alone = "tests/unit/test_pipeline.py::test_y[1]"
    assert split(None, alone) == alone


def test_a_test_not_marked_docker_reaches_no_engine() -> None:
    """DOCKER_HOST names a socket that is not there: the engine cannot be asked."""
    assert os.environ["DOCKER_HOST"].endswith("/no-engine.sock")
    with pytest.raises(docker.errors.DockerException):
        docker.from_env(timeout=5).ping()
