"""A pull's progress line from the engine's events, in the shape Docker's API streams them
(`id`, `status`, `progressDetail: {current, total}`): bytes, rate, time left, layers."""

from __future__ import annotations

import pytest

from sm121_build.core.console import LiveLine
from sm121_build.core.pull_progress import PullProgress

GB = 1000**3


def _events() -> list[dict[str, object]]:
    return [
        {"status": "Pulling from vllm/vllm-openai", "id": "nightly"},
        {"status": "Already exists", "progressDetail": {}, "id": "aaa"},
        {"status": "Pulling fs layer", "progressDetail": {}, "id": "bbb"},
        {"status": "Pulling fs layer", "progressDetail": {}, "id": "ccc"},
        {"status": "Downloading", "progressDetail": {"current": GB, "total": 4 * GB},
         "id": "bbb"},
    ]


def test_bytes_rate_and_time_left() -> None:
    progress = PullProgress("vllm/vllm-openai:nightly", started=0.0)
    for event in _events():
        progress.feed(event)
    # ccc has not started: its size is unknown, so the total is a floor
    assert progress.text(10.0) == ("pulling vllm/vllm-openai:nightly: 1.0 GB of ≥4.0 GB, "
                                   "100.0 MB/s, about 30s left (more to come), 1/3 layers")
    progress.feed({"status": "Downloading", "progressDetail": {"current": 10**6,
                                                                "total": 2 * GB}, "id": "ccc"})
    progress.feed({"status": "Download complete", "progressDetail": {}, "id": "bbb"})
    progress.feed({"status": "Pull complete", "progressDetail": {}, "id": "bbb"})
    assert progress.text(50.0) == ("pulling vllm/vllm-openai:nightly: 4.0 GB of 6.0 GB, "
                                   "80.0 MB/s, about 24s left, 2/3 layers")
    assert progress.summary(50.0) == ("pulled vllm/vllm-openai:nightly: 4.0 GB in 50s "
                                      "(80.0 MB/s), 3 layers (1 already here)")


def test_odd_events_are_ignored() -> None:
    progress = PullProgress("x:1", started=0.0)
    for odd in ({"status": "Digest: sha256:..."}, {"id": 3, "status": "x"},
                {"id": "l", "status": "Downloading", "progressDetail": "n/a"},
                {"id": "l", "status": "Downloading", "progressDetail": {"total": "big"}}):
        progress.feed(odd)
    assert progress.downloaded == 0 and progress.known == 0
    assert progress.text(1.0).startswith("pulling x:1: 0 B of 0 B, 0 B/s")


def test_plain_lines_every_n_seconds_and_the_last_text_kept(
        capsys: pytest.CaptureFixture[str]) -> None:
    clock = {"now": 0.0}
    live = LiveLine(every=30.0, clock=lambda: clock["now"], tty=False)
    for second in range(0, 100):
        clock["now"] = float(second)
        live(f"pulling x: {second}")
    said = capsys.readouterr().err.splitlines()
    assert said == ["    pulling x: 30", "    pulling x: 60", "    pulling x: 90"]
    assert live.last == "pulling x: 99"
