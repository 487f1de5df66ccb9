"""aot's compile loop (`jobs/aot_work/aot_compile`): every module once, never more threads at
work than cores, a failed module handed back as its error (the others go on), the line from
the first second, and the pace measured here kept for the next run's estimates (per ptxas version).
The compile itself is a stand-in here; the real ptxas runs in tests/unit/test_aot.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sm121_build.core.errors import ToolchainError
from sm121_build.cuda.ptxas_cost import Estimate
from sm121_build.jobs.aot_work.aot_compile import (
    Compiled,
    CompileInputs,
    compile_all,
    keep_pace,
    kept_pace,
)


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def test_every_module_once_within_the_cores_and_a_failure_is_handed_back(
        capsys: pytest.CaptureFixture[str]) -> None:
    costs = (Estimate(300.0, 1, 1, 300.0), *tuple(Estimate(10.0, 1, 1, 10.0) for _ in range(9)))
    inputs = CompileInputs(costs, tuple(1_000_000 for _ in costs), cores=4, split=True, pace=1.0,
                ptxas="13.0.88")
    lock, busy, peak, threads_of = threading.Lock(), [0], [0], {}

    def work(index: int, threads: int) -> Compiled:
        with lock:
            busy[0] += threads
            peak[0] = max(peak[0], busy[0])
            threads_of[index] = threads
        time.sleep(0.05)
        with lock:
            busy[0] -= threads
        if index == 3:
            raise ToolchainError("ptxas failed (exit 1): a stand-in failure")
        return Compiled(b"cubin", b"entry", costs[index].cpu_seconds * 0.5)

    done = dict(compile_all(inputs, work))
    assert sorted(done) == list(range(10))
    assert isinstance(done[3], ToolchainError)
    assert all(isinstance(done[i], Compiled) for i in range(10) if i != 3)
    assert peak[0] <= 4
    assert threads_of[0] > 1  # the module that would set the wall was split
    assert "aot [0/10]" in capsys.readouterr().err  # the line, before anything ended
    assert kept_pace("13.0.88") == pytest.approx(0.5, abs=0.01)  # measured / predicted
    assert kept_pace("13.5.37") == 1.0  # another ptxas: no pace of its own yet


def test_a_kept_pace_that_is_not_a_sane_number_is_not_used() -> None:
    keep_pace("13.0.88", 0.76)
    assert kept_pace("13.0.88") == pytest.approx(0.76)
    keep_pace("13.0.88", 1e6)
    assert kept_pace("13.0.88") == 1.0
