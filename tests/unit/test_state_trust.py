"""State you trust (issue 54, class A): the cache is untrusted, the state is the tool's own.

- nothing found in a cache becomes a record: a `ledger.json` restored into the cache folder is
  never read, and `prune` leaves the images it lists
- nothing is written through a link below the cache or state root (the user's own path to a
  root may hold links)
- a state folder that cannot be written is said in one line, and no cache entry is kept that
  the tool cannot vouch for (so no later run calls it "not written by this tool")
- the ledger is changed under a lock: runs at once never lose each other's records

Draft for tests/unit/ (uses tests/conftest.py's per-test state dir and tests/unit/conftest.py's
`isolated_cache`); the CLI cases run `aot` on a real nvcc-built file, as test_doors.py does.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from devkit.fakeengine import FakeEngine
from devkit.helpers import DATA, cli, compile_cached, cuda_home, gencode
from sm121_build.core.errors import Sm121Error
from sm121_build.core.paths import cache_dir, state_dir, store_bytes
from sm121_build.image import ledger
from sm121_build.image.api import ImageInfo
from sm121_build.jobs.upkeep.pruning import prune

pytestmark = pytest.mark.usefixtures("isolated_cache")
PLAIN_PTX = [*gencode("compute_80:compute_80", "compute_80:sm_80"), "--compress-mode=none"]


def _stranger(tmp_path: Path) -> tuple[FakeEngine, str]:
    """An engine (FAKE: no Docker in unit tests) with one untagged image this tool never
    made."""
    engine = FakeEngine(tmp_path / "engine")
    (tmp_path / "root").mkdir()
    image_id = engine.add_image("python:3.12", tmp_path / "root",
                                ImageInfo(ref="python:3.12", id="", repo_digests=(), os="linux",
                                          architecture="amd64", variant="", labels={},
                                          layers=()), [])
    engine.untag("python:3.12")
    return engine, image_id


# -- 1. a ledger in the cache is no record -----------------------------------------------------


def test_prune_never_removes_what_a_restored_cache_ledger_lists(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A runner whose ~/.cache came from elsewhere: its `ledger.json` lists an untagged
    image as a base a `--pull` replaced; prune removes nothing, nothing is moved into the
    state folder, the cache's file stays where it is, and it is said once."""
    engine, stranger = _stranger(tmp_path)
    restored = cache_dir() / "ledger.json"
    restored.parent.mkdir(parents=True)
    restored.write_text(json.dumps({"format": 1, "built": [], "replaced": [
        {"ref": "python:3.12", "image_id": stranger, "at": 1.0}]}))
    if hasattr(ledger, "_ignored"):
        ledger._ignored.cache_clear()
    result = prune(engine, keep=1)
    assert result.removed == [] and engine.image_id(stranger) == stranger
    assert f"remove {stranger}" not in engine.calls
    assert not (state_dir() / "ledger.json").exists()
    assert restored.is_file()
    ledger.record_built("sha256:" + "d" * 64, ["x:z"], "b")
    assert ledger.load().replaced == []
    assert capsys.readouterr().err.count("a ledger in the cache folder is not read") == 1


# -- 2. nothing written through a link -----------------------------------------------------------


@pytest.mark.parametrize("which", ["cache", "state"])
@pytest.mark.parametrize("linked", ["aot", "aot/ab"])
def test_nothing_is_written_through_a_link_below_a_root(tmp_path: Path, which: str,
                                                        linked: str) -> None:
    root = cache_dir() if which == "cache" else state_dir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = root / linked
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    stored = store_bytes(root / "aot" / "ab" / "abcd", b"entry")
    assert list(elsewhere.rglob("*")) == []
    assert stored is False


def test_a_link_in_the_users_own_path_to_the_root_is_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """~/.cache may be a link to a bigger disk: that is the user's, and the cache is written
    there; a file the name itself links to is never written through (the link is replaced)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "home-cache").symlink_to(disk, target_is_directory=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    assert store_bytes(cache_dir() / "aot" / "ab" / "abcd", b"entry") is not False
    assert (disk / "sm121-build" / "aot" / "ab" / "abcd").read_bytes() == b"entry"
    outside = tmp_path / "outside"
    outside.write_bytes(b"mine")
    (cache_dir() / "aot" / "ab" / "efgh").symlink_to(outside)
    store_bytes(cache_dir() / "aot" / "ab" / "efgh", b"entry")
    assert outside.read_bytes() == b"mine"


@pytest.fixture(scope="module")
def jit_so() -> Path:
    """An sm_80 cubin and compute_80 PTX, stored plain (JIT-only on sm_121)."""
    return compile_cached("doors_jit", DATA / "kernels.cu", PLAIN_PTX)


def _home(tmp_path: Path, state: Path | None = None) -> dict[str, str]:
    return {"CUDA_HOME": str(cuda_home()), "DOCKER_HOST": "unix:///nonexistent.sock",
            "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "XDG_STATE_HOME": str(state or tmp_path / "state")}


@pytest.mark.slow
def test_aot_writes_no_cache_entry_through_a_linked_cache_folder(jit_so: Path,
                                                                 tmp_path: Path) -> None:
    home = _home(tmp_path)
    first = cli("aot", str(jit_so), "--out", str(tmp_path / "o1"), "--target", "sm_121",
                env=home)
    assert first.returncode == 0, first.stderr
    entry = next(p for p in (tmp_path / "cache").rglob("*") if p.is_file())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    entry.unlink()
    entry.parent.rmdir()
    entry.parent.symlink_to(elsewhere, target_is_directory=True)  # a restored cache's link
    again = cli("aot", str(jit_so), "--out", str(tmp_path / "o2"), "--target", "sm_121",
                env=home)
    assert again.returncode == 0, again.stderr
    assert list(elsewhere.iterdir()) == []
    assert (tmp_path / "o1" / jit_so.name).read_bytes() == \
        (tmp_path / "o2" / jit_so.name).read_bytes()


# -- 3. a state folder that cannot be written ----------------------------------------------------


@pytest.mark.slow
def test_a_state_folder_that_cannot_be_written_is_said_and_nothing_unvouched_is_kept(
        jit_so: Path, tmp_path: Path) -> None:
    """XDG_STATE_HOME is a file (root ignores modes: a folder that cannot be made stands in
    for one that cannot be written).  Each run says so in one line and keeps no cache entry
    (its digest could not be kept); a later run with a working state folder then finds no
    entry to call "not written by this tool"."""
    blocked = tmp_path / "state-file"
    blocked.write_text("")
    home = _home(tmp_path, blocked)
    for n in (1, 2):
        done = cli("aot", str(jit_so), "--out", str(tmp_path / f"o{n}"), "--target",
                   "sm_121", env=home)
        assert done.returncode == 0, done.stderr
        said = [line for line in done.stderr.splitlines() if "cannot be written" in line]
        assert len(said) == 1 and str(blocked) in said[0], done.stderr
        assert "not written by this tool" not in done.stderr
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
    blocked.unlink()
    blocked.mkdir()
    fixed = cli("aot", str(jit_so), "--out", str(tmp_path / "o3"), "--target", "sm_121",
                env=home)
    assert fixed.returncode == 0, fixed.stderr
    assert "not written by this tool" not in fixed.stderr
    assert "cannot be written" not in fixed.stderr


# -- 4. the ledger under a lock ------------------------------------------------------------------


def _record(who: int, count: int) -> None:
    for n in range(count):
        ledger.record_built(f"sha256:{who:02d}{n:062d}", [f"x:{who}-{n}"], "b")


def test_runs_at_once_never_lose_each_others_records() -> None:
    """Processes (forked: the test's state folder is theirs) record at once: every record
    is kept (without the lock, a read-modify-write loses about half)."""
    fork = multiprocessing.get_context("fork")
    runs = [fork.Process(target=_record, args=(who, 60)) for who in range(3)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=120)
        assert run.exitcode == 0
    assert len(ledger.load().built) == 180
    assert [p.name for p in state_dir().iterdir() if p.name.startswith(".ledger.json.")] == []


class _Busy(FakeEngine):
    """An engine whose removal takes long enough for another run to record an image."""

    def remove_unused(self, image_id: str) -> str | None:
        ledger.record_built("sha256:" + "e" * 64, ["other-run:t"], "b")  # another run, now
        return super().remove_unused(image_id)


def test_prune_keeps_what_another_run_recorded_meanwhile(tmp_path: Path) -> None:
    engine = _Busy(tmp_path / "engine")
    (tmp_path / "root").mkdir()
    old = engine.add_image("vllm/vllm-openai:yesterday", tmp_path / "root",
                           ImageInfo(ref="x", id="", repo_digests=(), os="linux",
                                     architecture="amd64", variant="", labels={}, layers=()),
                           [])
    engine.untag("vllm/vllm-openai:yesterday")
    ledger.record_replaced("vllm/vllm-openai:nightly", old)
    result = prune(engine, keep=1)
    assert len(result.removed) == 1
    book = ledger.load()
    assert book.replaced == []
    assert [b.image_id for b in book.built] == ["sha256:" + "e" * 64]


def test_the_lock_is_never_taken_through_a_link(tmp_path: Path) -> None:
    """`ledger.lock` is opened with O_NOFOLLOW: a link there is refused in one line, and
    what it points at is never created or changed."""
    state_dir().mkdir(parents=True, exist_ok=True)
    (state_dir() / "ledger.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Sm121Error, match=r"could not take the ledger's lock"):
        ledger.record_built("sha256:" + "f" * 64, ["x:y"], "b")
    assert not os.path.lexists(tmp_path / "elsewhere")


def test_a_lock_never_let_go_ends_the_wait_in_one_line(tmp_path: Path) -> None:
    """Another process holding `ledger.lock` for good (a hung run) ends this run's wait after
    the lock's limit with one line naming the lock, never an endless wait."""
    import subprocess
    import sys

    from sm121_build.core import outputs

    state_dir().mkdir(parents=True, exist_ok=True)
    lock = state_dir() / "ledger.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"h = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(h, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.MonkeyPatch.context() as patch, \
                pytest.raises(Sm121Error, match=r"could not take the ledger's lock .*held by "
                                                r"another process for 0\.3 s"):
            patch.setattr(outputs, "LOCK_WAIT_S", 0.3)
            ledger.record_built("sha256:" + "f" * 64, ["x:y"], "b")
    finally:
        holder.kill()
        holder.wait()
