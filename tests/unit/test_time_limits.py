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
from sm121_build.core.errors import RegistryUnavailable, Sm121Error
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


class _Clock:
    """A FAKE clock: each event of the fake push stream advances it a second."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeApi:
    """The engine's push API (the boundary): a stream of events, one a FAKE second."""

    def __init__(self, events: list[dict[str, object]], clock: _Clock) -> None:
        self.events, self.clock, self.timeout, self.given = events, clock, 60.0, 0

    def push(self, *_args: object, **_kwargs: object) -> object:
        for event in self.events:
            self.clock.now += 1.0
            self.given += 1
            yield event


def _push(events: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch,
          registry_s: float = 5.0) -> tuple[BaseException | None, int]:
    """Engine.push of a tag against the FAKE stream: what it raised, and how many events
    it read."""
    from types import SimpleNamespace

    from sm121_build.image import engine as engine_module

    clock = _Clock()
    monkeypatch.setattr(engine_module, "_now", clock, raising=False)
    api = _FakeApi(events, clock)
    engine = engine_module.Engine.__new__(engine_module.Engine)
    engine.client = SimpleNamespace(api=api)  # type: ignore[assignment]
    engine.limits = Limits(120.0, registry_s)
    engine.logins = None  # Docker's config.json holds no login: the push is sent none
    try:
        engine.push("127.0.0.1:5000/rt-k:1")
    except Sm121Error as exc:
        return exc, api.given
    return None, api.given


def _pushing(layer: str, current: int) -> dict[str, object]:
    return {"status": "Pushing", "id": layer, "progressDetail": {"current": current,
                                                                 "total": 1000}}


def test_a_push_the_registry_drips_ends_after_the_limit_with_exit_7(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine keeps the push's stream alive while it retries a dripping registry (a
    countdown each second, the bytes sent again from 0): no progress for
    SM121_REGISTRY_TIMEOUT ends the push, exit 7, having read only the limit's worth of
    events (the stream here would go on for 1000 s, then the engine's 501)."""
    retried = [_pushing("a", 1000)]
    for _ in range(100):
        retried += [{"status": f"Retrying in {n} seconds", "id": "a"} for n in range(5, 0, -1)]
        retried += [_pushing("a", n) for n in (0, 500, 1000)]
        retried += [{"status": "Waiting", "id": "a"}, {"status": "Preparing", "id": "a"}]
    retried.append({"error": "received unexpected HTTP status: 501 Not Implemented"})
    raised, read = _push(retried, monkeypatch)
    assert isinstance(raised, RegistryUnavailable) and raised.exit_code == 7, raised
    assert "no progress in 5 s" in str(raised)
    assert read <= 1 + 5 + 2, read


def test_a_push_that_makes_progress_is_not_cut_and_a_refusal_is_exit_7(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow push whose bytes grow each second runs past the limit whole; the registry's
    refusal the engine relays is the registry's failure (exit 7), one line; a tag the
    engine does not have stays bad input (exit 2)."""
    slow = [{"status": "Preparing", "id": "a"}, *(_pushing("a", n) for n in range(1, 60)),
            {"status": "Pushed", "id": "a"}, {"status": "1: digest: sha256:ab size: 5"}]
    assert _push(slow, monkeypatch) == (None, len(slow))
    refused, _read = _push([{"status": "Preparing", "id": "a"},
                            {"error": "received unexpected HTTP status: 501 Not Implemented"}],
                           monkeypatch)
    assert isinstance(refused, RegistryUnavailable), refused
    assert str(refused) == ("cannot push 127.0.0.1:5000/rt-k:1: the registry refused or "
                            "failed: received unexpected HTTP status: 501 Not Implemented")
    missing, _read = _push([{"error": "An image does not exist locally with the tag: x"}],
                           monkeypatch)
    assert type(missing) is Sm121Error, missing
