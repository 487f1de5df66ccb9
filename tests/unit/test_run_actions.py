"""The main job's path choice (`jobs/main_run/run.ACTIONS`): which actions a run takes, in
which order, with what it hands on.  The actions' own work (the lookup, the injection, the
build, the push) has its own suites; here each is replaced by a recorder, and the session
runs on the FAKE engine (devkit/fakeengine.py), so what is tested is the choice alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from devkit.fakeengine import FakeEngine
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.binary import DEFAULT_POLICY
from sm121_build.cuda.compat import ArchList
from sm121_build.jobs.framework.pipeline import Keys, Pipeline
from sm121_build.jobs.framework.run_record import RunStatus
from sm121_build.jobs.main_run import run as run_mod
from sm121_build.jobs.main_run.main_plan import Options
from sm121_build.jobs.main_run.run import ACTIONS, Kernels, RunRequest, run_main

BASE, TAG = "stock:1", "stock:1-sm121"
NO_KEYS = Keys()


class Recorder:
    """Stands in for the four steps; says what each was asked."""

    def __init__(self, hit: bool, status: RunStatus = RunStatus.BUILT) -> None:
        self.hit, self.status = hit, status
        self.calls: list[tuple[str, Any]] = []

    def look_up(self, pipeline: Pipeline, repo: str, wanted: Any, dest: Path) -> Any:
        self.calls.append(("look up", (repo, wanted.pull)))
        return type("Found", (), {"folder": dest})() if self.hit else None

    def run_inject(self, pipeline: Pipeline, found: Any, base: str, dest: Any) -> str:
        self.calls.append(("inject", dest.tag))
        return dest.tag

    def run_build(self, pipeline: Pipeline, opts: Options) -> str:
        self.calls.append(("build", opts.pull))
        pipeline.record.ended(RunStatus.PLANNED if opts.plan_only else self.status)
        return opts.tag

    def publish_step(self, pipeline: Pipeline, folder: Path, repo: str, base: str,
                     replace_tag: bool = False) -> list[str]:
        self.calls.append(("publish", repo))
        return [f"{repo}:k-1"]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Recorder:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    engine = FakeEngine(tmp_path / "engine")
    monkeypatch.setattr(Pipeline, "connect", classmethod(
        lambda cls, record=None, steps=None, gpu=DEFAULT_POLICY, keys=NO_KEYS:
        cls(engine, record, steps, gpu, keys)))
    found = Recorder(hit=False)
    for name in ("look_up", "run_inject", "run_build", "publish_step"):
        monkeypatch.setattr(run_mod, name, getattr(found, name))
    return found


def _request(kernels: Kernels, plan_only: bool = False, pull: str = "missing") -> RunRequest:
    return RunRequest(Options(base=BASE, tag=TAG, arch=ArchList.parse("12.1"), extra_ext=(),
                              jobs=1, source=None, repo="/nonexistent", out=None, force=False,
                              no_patch=False, pull=pull, plan_only=plan_only), kernels)


def test_the_actions_are_in_their_order() -> None:
    assert [a.name for a in ACTIONS] == ["look up", "inject", "build", "publish"]


def test_a_plain_run_builds_and_nothing_else(recorder: Recorder) -> None:
    result = run_main(_request(Kernels()))
    assert result.actions == ("build",) and result.path == "build"
    assert recorder.calls == [("build", "missing")]


def test_a_hit_is_injected_and_never_built(recorder: Recorder) -> None:
    recorder.hit = True
    result = run_main(_request(Kernels(from_repo="reg/k", to_repo="other/k")))
    assert result.actions == ("look up", "inject", "publish")
    assert result.path == "kernels-hit" and result.pushed == ("other/k:k-1",)
    assert [c[0] for c in recorder.calls] == ["look up", "inject", "publish"]


def test_a_hit_is_not_pushed_back_where_it_came_from(recorder: Recorder) -> None:
    recorder.hit = True
    result = run_main(_request(Kernels(from_repo="reg/k", to_repo="reg/k")))
    assert result.pushed == () and [c[0] for c in recorder.calls] == ["look up", "inject"]


def test_a_miss_builds_without_pulling_again_then_publishes(recorder: Recorder) -> None:
    result = run_main(_request(Kernels(from_repo="reg/k", to_repo="reg/k")))
    assert result.actions == ("look up", "build", "publish") and result.path == "build"
    assert recorder.calls == [("look up", ("reg/k", "missing")), ("build", "never"),
                              ("publish", "reg/k")]


def test_a_miss_with_no_build_ends_the_run(recorder: Recorder) -> None:
    with pytest.raises(Sm121Error, match=r"no kernels image for stock:1 in reg/k .*--no-build"):
        run_main(_request(Kernels(from_repo="reg/k", no_build=True)))
    assert [c[0] for c in recorder.calls] == ["look up"]


def test_a_run_that_built_nothing_publishes_nothing(recorder: Recorder,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    recorder.status = RunStatus.NOT_NEEDED
    result = run_main(_request(Kernels(to_repo="reg/k")))
    assert result.pushed == () and [c[0] for c in recorder.calls] == ["build"]
    assert "--kernels-to reg/k: nothing was built, nothing to publish" in capsys.readouterr().err


def test_a_plan_neither_looks_up_nor_publishes(recorder: Recorder) -> None:
    result = run_main(_request(Kernels(from_repo="reg/k", to_repo="reg/k"), plan_only=True))
    assert result.actions == ("build",) and result.path == "planned"
    assert recorder.calls == [("build", "missing")]
