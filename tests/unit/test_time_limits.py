"""Every call that waits on something outside has a time limit (`core/limits.py`): an engine
socket that accepts and never answers ends in one line (exit 4) after SM121_ENGINE_TIMEOUT,
and a bad limit is refused before any work.  The registry side (a registry that never
answers: the lookup says so and the run builds; `inject --from` exits 7) is tested against
the real engine in tests/integration/test_e2e_docker.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from devkit.silent import silent_listener
from devkit.stallengine import host, stalling_engine
from sm121_build.core.errors import Sm121Error
from sm121_build.core.limits import DEFAULT_ENGINE_S, DEFAULT_REGISTRY_S, Limits


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                          text=True, check=False, env={**os.environ, **env}, timeout=120)


@pytest.mark.parametrize("command", [("pin", "vllm/vllm-openai:nightly"),
                                     ("audit", "vllm/vllm-openai:nightly"),
                                     ("--base", "vllm/vllm-openai:nightly", "--plan")])
def test_an_engine_that_never_answers_is_one_line_after_the_limit(
        command: tuple[str, ...]) -> None:
    with silent_listener() as address:
        started = time.monotonic()
        result = _run(*command, env={"DOCKER_HOST": f"tcp://{address}",
                                     "SM121_ENGINE_TIMEOUT": "2"})
        took = time.monotonic() - started
    assert result.returncode == 4, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: the Docker engine at tcp://{address} gave no answer in 2 s (set "
                     "SM121_ENGINE_TIMEOUT to wait longer)"], result.stderr
    assert took < 60  # the default would be 120 s; without a limit, forever


def test_an_engine_that_stops_answering_mid_run_is_one_line_after_the_limit() -> None:
    """It made the reader container and then answers nothing (the stat of a path, a HEAD
    whose caller names no time limit: without the client's own, forever): exit 4, one line
    that names the container it may have left."""
    with stalling_engine() as engine:
        result = _run("audit", "some/image", env={"DOCKER_HOST": host(engine),
                                                  "SM121_ENGINE_TIMEOUT": "2"})
    assert result.returncode == 4, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: engine connection lost"), lines
    assert "this run may have left container sm121-build-read-" in lines[0]


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf", "86401"])
def test_a_limit_that_is_not_seconds_is_refused_first(value: str) -> None:
    result = _run("pin", "vllm/vllm-openai:nightly",
                  env={"SM121_REGISTRY_TIMEOUT": value, "DOCKER_HOST": "unix:///nonexistent"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: SM121_REGISTRY_TIMEOUT={value!r}: expected a number of seconds above 0 and "
        "at most 86400")


def test_the_defaults_and_a_set_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SM121_ENGINE_TIMEOUT", raising=False)
    monkeypatch.setenv("SM121_REGISTRY_TIMEOUT", " 7.5 ")
    assert Limits.from_environment() == Limits(DEFAULT_ENGINE_S, 7.5)
    monkeypatch.setenv("SM121_ENGINE_TIMEOUT", "")
    assert Limits.from_environment().engine_s == DEFAULT_ENGINE_S
    assert DEFAULT_REGISTRY_S < DEFAULT_ENGINE_S
    monkeypatch.setenv("SM121_ENGINE_TIMEOUT", "1e9")
    with pytest.raises(Sm121Error):
        Limits.from_environment()
