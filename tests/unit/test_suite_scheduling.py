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


@pytest.fixture(scope="module")
def engine_seen_by_a_module_fixture() -> str | None:
    """What a fixture wider than a test sees: it is made before any fixture of the test's
    own scope (the engine's images of a module are made so)."""
    return os.environ.get("DOCKER_HOST")


def test_a_fixture_wider_than_the_test_reaches_no_engine_either(
        engine_seen_by_a_module_fixture: str | None) -> None:
    """Red team 11: the engine was shut only by a fixture of each test's scope, made after
    the module's and the session's: a module fixture of an unmarked test (`client_or_skip`,
    `stock_workspace`) reached the engine, beside the engine's tests."""
    assert (engine_seen_by_a_module_fixture or "").endswith("/no-engine.sock")
