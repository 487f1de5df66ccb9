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
from devkit.stallengine import host, stalling_engine
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


ENGINE_S = 30.0  # SM121_ENGINE_TIMEOUT of the stalled-engine test: the clean-up must not wait it


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize(("command", "signum"), [("audit", signal.SIGINT),
                                                 ("pin", signal.SIGTERM)])
def test_a_signal_while_the_engine_stalls(tmp_path: Path, command: str, signum: int) -> None:
    """The engine answered the run's first calls (it made a reader container) and then
    stopped answering: the interrupt's clean-up asks it to remove that container and is not
    held for SM121_ENGINE_TIMEOUT; the one line names the container it could not remove."""
    with stalling_engine() as engine:
        env = {**os.environ, "TMPDIR": str(tmp_path), "DOCKER_HOST": host(engine),
               "SM121_ENGINE_TIMEOUT": f"{ENGINE_S:g}"}
        process = subprocess.Popen([sys.executable, "-m", "sm121_build", command,
                                    "some/image"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert engine.stalled.wait(ENGINE_S), "the run never reached the stalled call"
            process.send_signal(signum)
            sent = time.monotonic()
            _, err = process.communicate(timeout=2 * ENGINE_S)
        finally:
            process.kill()
        waited = time.monotonic() - sent
    assert waited < ENGINE_S / 3, (waited, err)  # not the engine's time limit
    assert "Traceback" not in err, err
    assert process.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted; this run may have left container sm121-build-read-"), err
    assert list(tmp_path.iterdir()) == []


def test_an_image_the_engine_did_not_remove_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing an image the run made gets no answer (an interrupted run's clean-up asks a
    stalled engine): no error of its own replaces the interrupt, and the image is named among
    what the run may have left."""
    from sm121_build.core.leftovers import LEFT_BEHIND
    from sm121_build.image.engine import Engine

    image = "sha256:" + "cd" * 32
    with stalling_engine() as engine:
        monkeypatch.setenv("DOCKER_HOST", host(engine))
        monkeypatch.setenv("SM121_ENGINE_TIMEOUT", "0.5")
        connected = Engine.connect()
        try:
            connected.remove_created(image, set())
            assert f"image {image}" in LEFT_BEHIND
        finally:
            LEFT_BEHIND.discard(f"image {image}")
            connected.client.close()


def test_ctrl_c_during_local_leaves_no_compiler_temp_file(tmp_path: Path) -> None:
    """`local` interrupted while the build compiles: the compilers are killed (SIGKILL, so
    they never remove their own temp files: nvcc's tmpxft_*, gcc's cc*.s); they wrote
    them into the run's own temp folder (TMPDIR of the build), which goes with the run.
    The real build script runs, with a stand-in cmake whose build writes a temp file where
    TMPDIR says and then compiles for ever."""
    root = Path(__file__).resolve().parents[2]
    temp, cuda = tmp_path / "tmp", tmp_path / "cuda" / "bin"
    temp.mkdir()
    cuda.mkdir(parents=True)
    (cuda / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    cmake = tmp_path / "cmake"
    cmake.write_text('#!/bin/sh\n[ "$1" = --build ] || exit 0\n'
                     'echo x > "${TMPDIR:-/tmp}/tmpxft_0001_fake.cubin"\nexec sleep 600\n')
    cmake.chmod(0o755)
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\nfrom sm121_build.entry import main\n"
        "from sm121_build.jobs.payload import build_extensions\nreal = build_extensions.main\n"
        f"build_extensions.main = lambda argv, *rest: real([*argv, '--cmake', {str(cmake)!r}],"
        " *rest)\n"
        f"sys.argv = ['sm121-build', 'local', '--source', {str(root / 'tests/data/vllm_like')!r},"
        f" '--out', {str(tmp_path / 'out')!r}, '--no-patch']\nmain()\n")
    env = {**os.environ, "TMPDIR": str(temp), "CUDA_HOME": str(cuda.parent),
           "PYTHONPATH": str(root), "XDG_STATE_HOME": str(tmp_path / "state"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    process = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    for _ in range(1200):  # until the stand-in compiler has written its temp file
        if any(temp.rglob("tmpxft_*")) or process.poll() is not None:
            break
        time.sleep(0.05)
    assert any(temp.rglob("tmpxft_*")), process.communicate(timeout=60)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert sorted(temp.rglob("*")) == [], err


SIGNAL_IN_A_CLASS = '''
import os
import signal


class Kill:
    def __set_name__(self, owner, name):
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10000))  # the handler runs here, inside the class statement


class Made:
    field = Kill()
'''


def test_a_signal_inside_a_command_modules_class_statement_ends_with_130(tmp_path: Path
                                                                       ) -> None:
    # Python turns an interrupt raised inside `__set_name__` into a RuntimeError (a
    # dataclass field's does): the command's import is one step a signal cannot cut
    (tmp_path / "signal_in_import.py").write_text(SIGNAL_IN_A_CLASS)
    script = ("import sys\n"
              f"sys.path.insert(0, {str(tmp_path)!r})\n"
              "sys.argv = ['sm121-build', 'audit', 'x']\n"
              "from sm121_build import cli\n"
              "cli.COMMANDS['audit'] = ('signal_in_import', 'audit')\n"
              "cli.main()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("interrupted"), done.stderr


SIGNAL_AT_A_RETURN = '''
import os
import signal
import sys

target = sys.argv.pop(1)


def profile(frame, event, arg):
    if event == "return" and frame.f_code.co_name == target:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGTERM)


from sm121_build.cli import main

sys.setprofile(profile)
main()
'''


@pytest.mark.parametrize("where", ["invoke", "report_error", "format_message",
                                   "_run_command", "main"])
@pytest.mark.parametrize(("args", "code"), [(["audit", "/nonexistent"], 2),
                                            (["audit", "--bogus"], 2)])
def test_a_signal_as_the_command_ends(tmp_path: Path, where: str, args: list[str],
                                      code: int) -> None:
    """A SIGTERM caught as the command's end unwinds (an error reported, its exit status on
    its way out: CI once saw a traceback of a KeyboardInterrupt raised while a SystemExit
    passed through `main`): the run ends with its own status or 130, one line, no
    traceback.  The signal is sent when the named function returns."""
    driver = tmp_path / "driver.py"
    driver.write_text(SIGNAL_AT_A_RETURN)
    done = subprocess.run([sys.executable, str(driver), where, *args], capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (code, 130), done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "interrupted" if done.returncode == 130 else "error: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


SIGNAL_AT_A_QUALIFIED_RETURN = '''
import os
import signal
import sys

target, signame = sys.argv.pop(1), sys.argv.pop(1)


def profile(frame, event, arg):
    if event == "return" and frame.f_code.co_qualname == target:
        sys.setprofile(None)
        os.kill(os.getpid(), getattr(signal, signame))


from sm121_build.cli import main

sys.setprofile(profile)
main()
'''


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("where", ["_Group.invoke", "_ended"])
@pytest.mark.parametrize("command", ["audit", "doctor"])
def test_a_signal_after_the_command_returned_adds_no_blank_line(
        tmp_path: Path, host_only_so: Path, signame: str, where: str, command: str) -> None:
    """A signal as a command that has done its work returns (audit, exit 0) or exits with
    its own status (doctor's rank, a SystemExit) reaches no click code: click's `main`
    would print a blank line on stderr (closing a terminal's `^C` echo) before the
    interrupt's line (red team 5).  The run ends with its status, stderr untouched."""
    driver = tmp_path / "driver.py"
    driver.write_text(SIGNAL_AT_A_QUALIFIED_RETURN)
    args = ["audit", str(host_only_so)] if command == "audit" else ["doctor"]
    done = subprocess.run([sys.executable, str(driver), where, signame, *args],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin",
                               "DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode not in (130, -2, -15), done.stderr
    assert "\n\n" not in "\n" + done.stderr and "interrupted" not in done.stderr, done.stderr
