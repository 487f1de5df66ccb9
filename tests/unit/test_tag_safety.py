"""Tags and images that are not the tool's to move or remove, on the FAKE engine with real
files: the up-to-date skip reuses only an image the ledger says this tool built for that
content key (labels are inherited by a user's image built FROM a result); `--tag` never
takes a user's image's tag without `--replace-tag` and never the base's own; `prune` never
untags what it cannot remove, and prunes what `inject` made."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from devkit.fakeengine import FakeEngine, stock_image
from devkit.stockimage import VERSION
from sm121_build.core.errors import Sm121Error
from sm121_build.core.labels import CONTENT_KEY_LABEL
from sm121_build.cuda.compat import ArchList
from sm121_build.image import ledger
from sm121_build.image.refs import require_not_base
from sm121_build.jobs.formats.artifacts import load
from sm121_build.jobs.framework import run_record
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.jobs.kernel_images.injection import Destination, run_inject
from sm121_build.jobs.main_run.main_job import run_build
from sm121_build.jobs.main_run.main_plan import Options
from sm121_build.jobs.upkeep.pruning import prune

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

BASE = "vllm/vllm-openai:fixture"
TAG = "vllm/vllm-openai:fixture-sm121"
NAMES = ("_C.abi3.so", "_moe_C.abi3.so")


pytestmark = pytest.mark.usefixtures("isolated_cache")


def _engine(tmp_path: Path, matrix: dict[str, Path], commit: str) -> FakeEngine:
    engine = FakeEngine(tmp_path / "engine", compiled={n: matrix["sm121"] for n in NAMES})
    engine.work.mkdir()
    stock_image(engine, BASE, {n: matrix["sm90"] for n in NAMES}, VERSION, commit)
    return engine


def _run(engine: FakeEngine, source: Path, tag: str = TAG, force: bool = True,
         replace_tag: bool = False, out: Path | None = None) -> run_record.RunRecord:
    opts = Options(base=BASE, tag=tag, arch=ARCHS_121, extra_ext=(), jobs=2,
                   source=source,
                   repo="/nonexistent", out=out, force=force, no_patch=True,
                   replace_tag=replace_tag)
    record = run_record.new_record("build", BASE, tag, ARCHS_121)
    with run_record.recorded(record, None, None):
        run_build(Pipeline(engine, record), opts)
    return record


def _two_builds(tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]
                ) -> tuple[FakeEngine, run_record.RunRecord, run_record.RunRecord]:
    """An older build (tagged `…:old`) and a newer one of another compile (`TAG`)."""
    engine = _engine(tmp_path, matrix, checkout[1])
    old = _run(engine, checkout[0], tag="vllm/vllm-openai:old")
    engine.compiled = {n: matrix["lz4"] for n in NAMES}
    return engine, old, _run(engine, checkout[0])


def _user_image(engine: FakeEngine, tag: str, labels: dict[str, str]) -> str:
    """An image the user made (e.g. `FROM` a result: it inherits the result's labels)."""
    base = engine.images[engine.tags[BASE]]
    return engine.add_image(tag, base.root, replace(base.info, labels=labels), base.history)


def test_the_skip_never_reuses_a_users_image_that_inherited_the_key(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    first = _run(engine, checkout[0], force=False)
    ours = engine.images[first.image_id].info
    app = _user_image(engine, "myapp:1", dict(ours.labels))  # FROM the result
    assert engine.find_by_label(CONTENT_KEY_LABEL, first.content_key or "")
    engine.untag(TAG)
    engine.remove_unused(first.image_id)  # the user removed our image; theirs remains
    again = _run(engine, checkout[0], force=False)
    assert again.status == "built"  # not "up-to-date" on the user's image
    assert engine.tags[TAG] == again.image_id != app
    assert engine.tags["myapp:1"] == app


def test_the_skip_reuses_our_own_image(tmp_path: Path, matrix: dict[str, Path],
                                       checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    first = _run(engine, checkout[0], force=False)
    _user_image(engine, "myapp:1", dict(engine.images[first.image_id].info.labels))
    engine.calls.clear()
    again = _run(engine, checkout[0], force=False)
    assert again.status == "up-to-date" and again.image_id == first.image_id
    assert engine.calls == [f"tag {TAG}"]


def test_tag_naming_a_users_image_is_refused_before_any_work(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    app = _user_image(engine, "myapp:1", {"maintainer": "me"})
    with pytest.raises(Sm121Error) as refused:
        _run(engine, checkout[0], tag="myapp:1")
    assert refused.value.exit_code == 2
    assert str(refused.value) == (
        f"--tag myapp:1 already names image {app.split(':')[1][:12]} (sm121-build did not build "
        "it): choose another --tag, or --replace-tag to move it (the image itself stays)")
    assert engine.calls == [] and engine.tags["myapp:1"] == app
    record = _run(engine, checkout[0], tag="myapp:1", replace_tag=True)
    assert engine.tags["myapp:1"] == record.image_id and app in engine.images


def test_tag_never_moves_the_bases_own_tag(tmp_path: Path, matrix: dict[str, Path],
                                           checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    stock = engine.tags[BASE]
    engine.tag(stock, "mirror/vllm:same")  # another name of the base image
    for tag in (BASE, "mirror/vllm:same"):
        with pytest.raises(Sm121Error, match="names the base image itself"):
            _run(engine, checkout[0], tag=tag, replace_tag=True)
        assert engine.tags[tag] == stock
    with pytest.raises(Sm121Error, match="is the base image's own reference"):
        require_not_base("docker.io/vllm/vllm-openai:fixture", BASE)
    require_not_base(TAG, BASE)


def test_a_rebuild_moves_its_own_tag(tmp_path: Path, matrix: dict[str, Path],
                                     checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    first = _run(engine, checkout[0])
    engine.compiled = {n: matrix["lz4"] for n in NAMES}  # a new compile: another image
    second = _run(engine, checkout[0])
    assert first.image_id != second.image_id and engine.tags[TAG] == second.image_id
    book = ledger.load()
    entry = book.entry(second.image_id)
    assert entry and (entry.base_ref, entry.content_key) == (BASE, second.content_key)


def test_a_tag_from_a_build_of_another_base_is_not_taken(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    first = _run(engine, checkout[0])
    book = ledger.load()
    entry = book.entry(first.image_id)
    assert entry
    entry.base_ref = "vllm/vllm-openai:other"
    ledger.save(book)
    with pytest.raises(Sm121Error, match=r"sm121-build built it from vllm/vllm-openai:other"):
        _run(engine, checkout[0])


def test_inject_refuses_a_users_tag(tmp_path: Path, matrix: dict[str, Path],
                                    checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    _run(engine, checkout[0], out=tmp_path / "out")
    app = _user_image(engine, "myapp:1", {})
    with pytest.raises(Sm121Error, match="already names image"):
        run_inject(Pipeline(engine), load(tmp_path / "out"), BASE, Destination("myapp:1"))
    assert engine.tags["myapp:1"] == app
    with pytest.raises(Sm121Error, match="names the base image itself"):
        run_inject(Pipeline(engine), load(tmp_path / "out"), BASE,
                   Destination(BASE, replace_tag=True))


def test_prune_never_untags_what_it_cannot_remove(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine, old, _ = _two_builds(tmp_path, matrix, checkout)
    engine.users[old.image_id] = "image 0123456789ab builds on it"
    engine.calls.clear()
    result = prune(engine, keep=1)
    assert engine.calls == []  # not even untagged for a moment
    assert result.kept == [f"{old.image_id.split(':')[1][:12]}: image 0123456789ab builds on it"]
    assert result.removed == [] and engine.tags["vllm/vllm-openai:old"] == old.image_id
    del engine.users[old.image_id]
    result = prune(engine, keep=1)
    assert result.removed == [f"{old.image_id.split(':')[1][:12]} (vllm/vllm-openai:old)"]
    assert old.image_id not in engine.images


def test_prune_gives_the_tags_back_when_the_engine_still_refuses(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine, old, _ = _two_builds(tmp_path, matrix, checkout)
    monkeypatch.setattr(engine, "remove_unused", lambda image_id: "conflict: in use")
    result = prune(engine, keep=1)
    assert result.kept == [f"{old.image_id.split(':')[1][:12]}: conflict: in use"]
    assert engine.tags["vllm/vllm-openai:old"] == old.image_id


def test_prune_removes_what_inject_made(tmp_path: Path, matrix: dict[str, Path],
                                        checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    _run(engine, checkout[0], out=tmp_path / "out")
    record = run_record.new_record("inject", BASE, "x:injected", None)
    run_inject(Pipeline(engine, record), load(tmp_path / "out"), BASE, Destination("x:injected"))
    engine.compiled = {n: matrix["lz4"] for n in NAMES}
    _run(engine, checkout[0], tag="vllm/vllm-openai:newer")
    book = ledger.load()
    injected = book.entry(engine.tags["x:injected"])
    assert injected is not None
    injected.at = 0  # the oldest
    ledger.save(book)
    result = prune(engine, keep=2)
    assert result.removed == [f"{record.image_id.split(':')[1][:12]} (x:injected)"]


def test_a_damaged_ledger_is_refused_and_never_overwritten(tmp_path: Path) -> None:
    """Read as empty, the next save would overwrite it and prune would forget every image it
    listed: a damaged ledger is one line that says how to recover, and stays as it is."""
    from sm121_build.core.paths import state_dir

    path = state_dir() / "ledger.json"
    path.parent.mkdir(parents=True)
    good = {"image_id": "sha256:" + "a" * 64, "tags": ["x:y"], "base_id": "b", "at": 1.0}
    damaged = [json.dumps({"built": [good, {"image_id": 5, "tags": "x", "base_id": "b",
                                            "at": 1}]}),
               json.dumps({"built": [good, [1]]}), json.dumps({"built": [good, {"x": 1}]}),
               json.dumps({"built": [good], "replaced": {"not": "a list"}}),
               "[1, 2]", "{" * 100000, "\"text\"", "null", "", "\xff\xfe"]
    for raw in damaged:
        path.write_text(raw)
        with pytest.raises(Sm121Error, match=r"is damaged .*: it is left as it is; move it "
                                             r"aside \(`mv .*ledger.json .*\.damaged`\)"):
            ledger.load()
        with pytest.raises(Sm121Error):
            ledger.record_built("sha256:" + "c" * 64, ["n:t"], "b")
        assert path.read_text() == raw
    path.write_text(json.dumps({"built": [good]}))
    assert [b.image_id for b in ledger.load().built] == [good["image_id"]]
    path.unlink()
    assert ledger.load() == ledger.Ledger()


def test_a_ledger_write_that_fails_is_an_error_and_keeps_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk: the write fails at fsync; the error says so, no temporary file is left,
    the ledger keeps what it had."""
    import os

    from sm121_build.core.paths import state_dir

    ledger.record_built("sha256:" + "a" * 64, ["x:y"], "b")
    path = state_dir() / "ledger.json"
    before = path.read_text()

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)  # FAKE: the disk filling up mid-write
    with pytest.raises(Sm121Error, match=r"could not write the ledger .*No space left"):
        ledger.record_built("sha256:" + "b" * 64, ["x:z"], "b")
    monkeypatch.undo()
    assert path.read_text() == before
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".ledger-")] == []


def test_two_runs_of_one_key_never_share_a_log(tmp_path: Path, matrix: dict[str, Path],
                                               checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    first, second = Pipeline(engine).new_log("build-k"), Pipeline(engine).new_log("build-k")
    assert first != second and first.parent == second.parent
    assert first.name.startswith("build-k.") and first.suffix == ".log"


def test_wiping_the_cache_does_not_forget_what_was_built(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """The ledger is state: after `rm -rf ~/.cache/sm121-build`, prune still knows the tool's
    images (and the logs are still there)."""
    import shutil

    from sm121_build.core.paths import cache_dir, state_dir

    engine, old, _ = _two_builds(tmp_path, matrix, checkout)
    shutil.rmtree(cache_dir())
    assert old.log and Path(old.log).is_file() and Path(old.log).is_relative_to(state_dir())
    result = prune(engine, keep=1)
    assert result.removed == [f"{old.image_id.split(':')[1][:12]} (vllm/vllm-openai:old)"]


def test_a_ledger_in_the_cache_is_never_read(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A cache may be restored from another machine: a `ledger.json` there (where old
    versions kept it) is no record of this machine's images; it is said once, left as it
    is, and never moved into the state folder."""
    from sm121_build.core.paths import cache_dir, state_dir

    entry = {"image_id": "sha256:" + "c" * 64, "tags": ["x:y"], "base_id": "b", "at": 2.0}
    old = cache_dir() / "ledger.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"format": 1, "built": [entry], "replaced": []}))
    ledger._ignored.cache_clear()
    assert ledger.load() == ledger.Ledger()
    ledger.record_built("sha256:" + "d" * 64, ["x:z"], "b")
    assert [b.image_id for b in ledger.load().built] == ["sha256:" + "d" * 64]
    assert old.is_file() and (state_dir() / "ledger.json").is_file()
    assert capsys.readouterr().err.count("a ledger in the cache folder is not read") == 1


def test_prune_dry_run_and_the_bases_a_pull_replaced(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """Old bases: removed once untagged, kept (with the tag named) while tagged; a dry run
    removes nothing and says what it would; the ledger forgets only what is gone."""
    engine, old, new = _two_builds(tmp_path, matrix, checkout)
    replaced = stock_image(engine, "vllm/vllm-openai:yesterday", {}, VERSION, checkout[1])
    kept_base = stock_image(engine, "vllm/vllm-openai:pinned", {}, VERSION, checkout[1])
    ledger.record_replaced("vllm/vllm-openai:nightly", replaced)
    ledger.record_replaced("vllm/vllm-openai:nightly", kept_base)
    ledger.record_replaced("vllm/vllm-openai:nightly", "sha256:" + "0" * 64)  # gone already
    engine.untag("vllm/vllm-openai:yesterday")
    short = {i: i.split(":")[1][:12] for i in (old.image_id or "", replaced, kept_base)}
    with pytest.raises(Sm121Error, match="keep at least the newest build"):
        prune(engine, keep=0)
    engine.calls.clear()
    dry = prune(engine, keep=1, dry_run=True)
    assert engine.calls == [] and old.image_id in engine.images and replaced in engine.images
    assert dry.removed == [f"{short[old.image_id or '']} (vllm/vllm-openai:old)",
                           f"{short[replaced]} (old vllm/vllm-openai:nightly, untagged)"]
    assert dry.kept == [f"{short[kept_base]} (old vllm/vllm-openai:nightly): tagged "
                        "vllm/vllm-openai:pinned"]
    assert len(ledger.load().replaced) == 3  # a dry run changes nothing
    done = prune(engine, keep=1)
    assert (done.removed, done.kept) == (dry.removed, dry.kept)
    assert old.image_id not in engine.images and replaced not in engine.images
    book = ledger.load()
    assert [b.image_id for b in book.built] == [new.image_id]
    assert [r.image_id for r in book.replaced] == [kept_base]
    engine.users[kept_base] = "container 0123456789ab uses it"
    engine.untag("vllm/vllm-openai:pinned")
    assert prune(engine, keep=1).kept == [
        f"{short[kept_base]} (old vllm/vllm-openai:nightly): container 0123456789ab uses it"]
    assert kept_base in engine.images


def test_prune_leaves_an_image_another_tag_names(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine, old, _ = _two_builds(tmp_path, matrix, checkout)
    engine.tag(old.image_id or "", "mine:keep")
    result = prune(engine, keep=1)
    assert result.kept == [f"{(old.image_id or '').split(':')[1][:12]}: also tagged mine:keep "
                           "(not by sm121-build)"] and result.removed == []


def test_prune_goes_on_past_a_kept_image_and_names_every_tag(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    records = []
    for number, variant in enumerate(("sm121", "lz4", "zstd", "plain")):
        engine.compiled = {n: matrix[variant] for n in NAMES}
        records.append(_run(engine, checkout[0], tag=f"vllm/vllm-openai:b{number}"))
    b0, b1, b2 = (r.image_id or "" for r in records[:3])
    engine.tag(b2, "mine:keep")  # the first candidate (newest first) is kept: go on past it
    engine.tag(b0, "vllm/vllm-openai:b0-again")
    ledger.record_built(b0, ["vllm/vllm-openai:b0-again"], engine.tags[BASE])
    book = ledger.load()
    for age, record in enumerate(records):  # b0 oldest … b3 newest
        entry = book.entry(record.image_id or "")
        assert entry
        entry.at = float(age)
    ledger.save(book)
    engine.untag("vllm/vllm-openai:b1")  # an old build the user untagged
    olds = [replaced := stock_image(engine, "vllm/vllm-openai:o1", {}, VERSION, checkout[1]),
            stock_image(engine, "vllm/vllm-openai:o2", {}, VERSION, checkout[1])]
    engine.tag(replaced, "vllm/vllm-openai:o1-again")
    for image in olds:
        ledger.record_replaced("vllm/vllm-openai:nightly", image)
    engine.untag("vllm/vllm-openai:o2")
    result = prune(engine, keep=1)
    short = {i: i.split(":")[1][:12] for i in (b0, b1, b2, *olds)}
    assert sorted(result.removed) == sorted([
        f"{short[b1]} (untagged)",
        f"{short[b0]} (vllm/vllm-openai:b0, vllm/vllm-openai:b0-again)",
        f"{short[olds[1]]} (old vllm/vllm-openai:nightly, untagged)"])
    assert sorted(result.kept) == sorted([
        f"{short[b2]}: also tagged mine:keep (not by sm121-build)",
        f"{short[olds[0]]} (old vllm/vllm-openai:nightly): tagged vllm/vllm-openai:o1, "
        "vllm/vllm-openai:o1-again"])


def test_a_log_is_never_made_through_a_link_in_the_state(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`state/sm121-build/logs` linked elsewhere: nothing is written there, one-line error."""
    engine = _engine(tmp_path, matrix, checkout[1])
    state = tmp_path / "linked-state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (state / "sm121-build").mkdir(parents=True)
    (state / "sm121-build" / "logs").symlink_to(elsewhere)
    with pytest.raises(Sm121Error, match="nothing is written through a link") as caught:
        Pipeline(engine).new_log("inject-k")
    assert "\n" not in str(caught.value)
    assert list(elsewhere.iterdir()) == []
