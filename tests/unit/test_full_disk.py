"""A full disk (issue #62): a result (`--summary-md`, `--report`, `--json` on stdout, aot's
`--out` files) is written whole or not at all, and the one `error:` line names the file.

FAKE: the disk filling up is `os.write` (or the result's writer) failing with ENOSPC once
`room` bytes of that one file went out, after a short write as the kernel makes it."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import BinaryIO

import pytest

from sm121_build.core import console
from sm121_build.core.outputs import NotWritten, Results, append_text, replace_text

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fill_up(monkeypatch: pytest.MonkeyPatch, path: Path, room: int) -> None:
    """`os.write` to `path` takes `room` more bytes, then the disk is full."""
    real = os.write
    left = [room]

    def write(fd: int, data: bytes | memoryview) -> int:
        try:
            ours = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            ours = False
        if not ours:
            return real(fd, data)
        if not left[0]:
            raise NO_SPACE
        taken = min(len(memoryview(data)), left[0])
        left[0] -= taken
        return real(fd, memoryview(data)[:taken])

    monkeypatch.setattr(os, "write", write)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_summary_the_disk_cuts_short_keeps_what_it_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$GITHUB_STEP_SUMMARY with an earlier step's text: a table the disk cuts after 100
    bytes leaves it as it was, and the error names it."""
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    _fill_up(monkeypatch, summary, 100)
    table = "| a | b |\n| --- | --- |\n" + "| x | y |\n" * 1000
    with pytest.raises(NotWritten, match=rf"^{summary}: No space left on device: not written"):
        append_text(summary, table)
    monkeypatch.undo()
    assert summary.read_text() == "earlier step\n"
    append_text(summary, table)  # room again: written whole
    assert summary.read_text() == "earlier step\n" + table


@pytest.mark.parametrize("fails_at", ["write", "fsync", "replace"])
def test_a_result_the_disk_cuts_short_is_not_written_and_names_its_file(
        fails_at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """aot's --out file and --report (one door, `replace_file`): the old file stays, no
    temporary file is left, and the error names the file, not only "No space left"."""
    results = Results(tmp_path / "out", ())
    target = results.claim(Path("pkg/_C.abi3.so"), "_C.abi3.so")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"old")

    def write(out: BinaryIO) -> None:
        out.write(b"\x7fELF" * 1024)
        if fails_at == "write":
            raise NO_SPACE

    if fails_at != "write":
        monkeypatch.setattr(os, fails_at, lambda *args: (_ for _ in ()).throw(NO_SPACE))
    with pytest.raises(NotWritten, match=rf"^{target}: No space left on device: not written"):
        results.write(target, write)
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and _leftovers(target.parent) == []
    report = tmp_path / "report.json"
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(NO_SPACE))
    with pytest.raises(NotWritten, match=rf"^{report}: No space"):
        replace_text(report, "{}")
    assert not report.exists() and _leftovers(tmp_path) == []


def test_json_on_a_full_disk_is_not_half_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--json > result.json` on a full disk: Python's stdout takes a short write for a
    whole one (half a JSON document, exit 0); the file is left as it was and the error
    names it."""
    result = tmp_path / "result.json"
    data = {"binaries": [{"name": f"lib{i}.so"} for i in range(500)]}
    with open(result, "w", encoding="utf-8") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        console.say_json({"first": 1})  # room for it
        _fill_up(monkeypatch, result, 1000)
        with pytest.raises(NotWritten, match=rf"^stdout \({result}\): No space left"):
            console.say_json(data)
        monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    monkeypatch.undo()
    assert json.loads(result.read_text()) == {"first": 1}


def test_the_error_line_of_a_full_disk_names_the_file(
        plain_so: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command: one `error:` line naming the summary, exit 2, the summary as
    it was."""
    from sm121_build.cli import cli

    summary = tmp_path / "summary.md"
    summary.write_text("earlier\n")
    _fill_up(monkeypatch, summary, 10)
    with pytest.raises(SystemExit) as ended:
        cli.main(["audit", str(plain_so), "--summary-md", str(summary)],
                 standalone_mode=False)
    assert ended.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"error: {summary}: No space left on device: not written (it holds "
                      "what it held before)"]
    monkeypatch.undo()
    assert summary.read_text() == "earlier\n"


def test_a_run_whose_report_the_disk_refuses_still_writes_its_summary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The main job's results: `--report` on a full disk does not stop `--summary-md`; a
    run that did its work ends with the report's error, one that failed with its own
    error (the report's said in a note)."""
    from sm121_build.core.errors import Sm121Error
    from sm121_build.jobs.framework.run_record import new_record, recorded

    report, summary = tmp_path / "full" / "report.json", tmp_path / "summary.md"
    report.parent.mkdir()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).parent == report.parent:
            raise NO_SPACE
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(NotWritten, match=rf"^{report}: No space"), \
            recorded(new_record("build", "b:1", "b:1-sm121", None), report, summary):
        pass
    assert summary.read_text().startswith("## sm121-build:") and not report.exists()
    with pytest.raises(Sm121Error, match=r"^the build failed$"), \
            recorded(new_record("build", "b:1", "b:1-sm121", None), report, summary):
        raise Sm121Error("the build failed")
    assert f"note: {report}: No space" in capsys.readouterr().err
    assert "**FAILED**: the build failed" in summary.read_text()
    assert _leftovers(report.parent) == []
