"""Signals are held from the entry module's first line: a Ctrl-C or SIGTERM at any moment
after the interpreter has started the tool's code ends the run with exit 130 (or lets it end
on its own, 0), one line, no traceback, and nothing left in the temp folder.  (The
interpreter's own start, before any line of the tool runs, is not the tool's: the test waits
for the entry module's hold, `devkit.worlds.tool_started`.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devkit.helpers import EMULATED, EMULATED_WHY
from devkit.worlds import tool_started

DELAYS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8)  # after the tool's first line


def _interrupted(args: list[str], tmp: Path, signum: int, delay: float) -> tuple[int, str]:
    env = {**os.environ, "TMPDIR": str(tmp)}
    process = subprocess.Popen([sys.executable, "-m", "sm121_build", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
    tool_started(process.pid)
    time.sleep(delay)
    process.send_signal(signum)
    sent = time.monotonic()
    _, err = process.communicate(timeout=60)
    assert time.monotonic() - sent < 2.0, err
    return process.returncode, err


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_at_any_moment_of_an_audit(plain_so: Path, tmp_path: Path,
                                            signum: int) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(8):
        (folder / f"k{i}.so").write_bytes(plain_so.read_bytes())
    for delay in DELAYS:
        tmp = tmp_path / f"tmp{delay}"
        tmp.mkdir()
        code, err = _interrupted(["audit", str(folder), "--kernels"], tmp, signum, delay)
        assert "Traceback" not in err, (delay, err)
        assert code in (0, 130), (delay, code, err)
        if code == 130:
            assert err.strip().splitlines()[-1].startswith("interrupted"), err
        assert list(tmp.iterdir()) == [], delay
