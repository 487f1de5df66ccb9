"""The one way a program is started (`core/children.py`): no other module starts one; each runs
in a group of its own that is killed on its deadline, on an interrupt and after it exits; its
output is bounded; a tool that exits 0 and writes nothing is named as such; and a Ctrl-C or
SIGTERM ends a whole run within seconds, with every program it started gone."""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.helpers import EMULATED, EMULATED_WHY
from sm121_build.core import children
from sm121_build.core.children import Kept, Lines, Program, end_all, run
from sm121_build.core.errors import ToolchainError
from sm121_build.cuda.ptxas import Compile, Toolchain, fatbin_entry, run_ptxas

PACKAGE = Path(__file__).resolve().parents[2] / "sm121_build"
DOOR = "core/children.py"
# runs inside the builder container, on the standard library only (a contract forbids any
# import of the package): the build's own compiler calls
OUTSIDE = {"jobs/payload/build_extensions.py",
           # `prove`'s children, run by the user's interpreter on the GPU's machine: the
           # standard library and torch only (the same contract); they print JSON lines
           # the job parses, and read the cubins and list the job wrote for them
           "jobs/payload/load_cubins.py", "jobs/payload/harness_fa2.py",
           "jobs/payload/harness_marlin.py", "jobs/payload/compare_outputs.py",
           "jobs/payload/harness_run.py", "jobs/payload/fa2_kernels.py",
           "jobs/payload/marlin_kernels.py", "jobs/payload/case_files.py"}
STARTS = {"system", "popen", "spawnl", "spawnv", "spawnvp", "execv", "execvp", "execve",
          "fork", "forkpty", "posix_spawn", "posix_spawnp", "create_subprocess_exec"}


def _starts(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names]
            found += [f"import {n}" for n in names if n.split(".")[0] in ("subprocess", "pty")]
        elif isinstance(node, ast.Attribute) and node.attr in STARTS:
            found.append(ast.unparse(node))
    return found


def test_no_module_but_the_door_starts_a_program() -> None:
    strays = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in OUTSIDE or rel == DOOR:
            continue
        found = _starts(ast.parse(path.read_text()))
        if found:
            strays[rel] = found
    assert strays == {}, "start programs through core/children.run"


def test_the_scan_sees_a_start() -> None:
    assert _starts(ast.parse("import subprocess\nos.system('x')\n")) == [
        "import subprocess", "os.system"]


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _end_every_process_naming(part: str) -> None:
    """Test hygiene, whatever the test found: SIGKILL every process whose command line holds
    `part` (a path of this test's temp folder) until none is left.  A promise mutant that
    breaks the ending of a tree fails the test, and must not leave the tree running on the
    machine (a run of the mutants left 113 of a 300-deep chain, and a `sleep 600`)."""
    wanted = part.encode()
    for _ in range(100):
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if wanted in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    continue
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _no_sleeper_left(tmp_path: Path) -> Iterator[None]:
    """Test hygiene: after each test, every pid a test wrote under its temp folder that
    still runs `sleep` is ended, whether the test passed or not (a promise mutant that breaks
    the ending of programs fails these tests and left their `sleep 600`s running)."""
    yield
    for written in tmp_path.rglob("*"):
        if written.is_file() and not written.is_symlink() and written.stat().st_size < 32:
            text = written.read_text(errors="replace").strip()
            if text.isdigit():
                _end_if_running(int(text), b"sleep\x00")


def _end_if_running(pid: int, command: bytes) -> None:
    """SIGKILL `pid` when its command line still starts with `command` (a pid the test
    recorded, not one the system has given to another program since)."""
    try:
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(command):
            os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() \
        else "X"
    return state not in ("Z", "X")


def test_a_program_that_never_stops_printing_costs_bounded_memory(tmp_path: Path) -> None:
    done = run(Program(("yes", "x" * 100), 1.0, "yes"))
    assert done.timed_out
    assert len(done.stdout) <= 2 * children.KEPT + 100
    assert done.dropped > 10 * children.KEPT
    assert done.stdout.startswith(b"x" * 100)


def test_the_deadline_kills_what_a_wrapper_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    shim = _script(tmp_path, "shim", f"sleep 600 &\necho $! > {pidfile}\nwait\n")
    started = time.monotonic()
    done = run(Program((str(shim),), 1.0, "shim"))
    assert done.timed_out
    assert time.monotonic() - started < 5
    grandchild = int(pidfile.read_text())
    time.sleep(0.2)
    assert not _alive(grandchild), "the wrapper's child outlived the deadline"


def test_what_a_program_leaves_behind_is_ended_with_it(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    leaver = _script(tmp_path, "leaver",
                     f"sleep 600 >/dev/null 2>&1 &\necho $! > {pidfile}\nexit 0\n")
    done = run(Program((str(leaver),), 30.0, "leaver"))
    assert done.returncode == 0 and not done.timed_out
    time.sleep(0.2)
    assert not _alive(int(pidfile.read_text()))
    assert len(children._GROUPS) == 0


def test_end_all_ends_a_program_waited_on_by_another_thread(tmp_path: Path) -> None:
    results: list[children.Ended] = []
    waiter = threading.Thread(target=lambda: results.append(
        run(Program(("sleep", "600"), 600.0, "sleep"))))
    waiter.start()
    for _ in range(200):
        if len(children._GROUPS):
            break
        time.sleep(0.01)
    try:
        end_all()
        waiter.join(5)
        assert not waiter.is_alive()
        assert results[0].returncode == -signal.SIGKILL
        with pytest.raises(children.Ending):
            run(Program(("true",), 5.0, "true"))
    finally:
        children._ENDING.clear()


def test_stdout_and_stderr_apart_and_merged() -> None:
    apart = run(Program(("sh", "-c", "echo out; echo err >&2; exit 3"), 10.0, "sh"))
    assert (apart.returncode, apart.stdout, apart.stderr) == (3, b"out\n", b"err\n")
    assert apart.said() == "err"
    merged = run(Program(("sh", "-c", "echo out; echo err >&2"), 10.0, "sh", merge=True))
    assert merged.stdout == b"out\nerr\n" and merged.stderr == b""


def test_a_program_that_cannot_start_is_an_os_error() -> None:
    with pytest.raises(OSError):
        run(Program(("/nonexistent/tool",), 5.0, "tool"))


def test_kept_holds_both_ends() -> None:
    kept = Kept(4)
    for chunk in (b"ab", b"cdef", b"ghij", b"k"):
        kept.add(chunk)
    assert (bytes(kept.head), bytes(kept.tail), kept.dropped) == (b"abcd", b"hijk", 3)
    assert kept.value() == b"abcd\n[\xe2\x80\xa6 3 bytes left out \xe2\x80\xa6]\nhijk"


def test_lines_cut_a_line_that_never_ends() -> None:
    seen: list[str] = []
    lines = Lines(seen.append, width=8)
    lines(b"one\ntw")
    lines(b"o\n" + b"x" * 20)
    lines.close()
    assert seen == ["one\n", "two\n", "x" * 8, "x" * 8, "x" * 4]


def _toolchain(tmp_path: Path, ptxas_body: str, fatbinary_body: str = "exit 0\n") -> Toolchain:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir, "ptxas", 'case "$1" in --version) echo "Cuda compilation tools, '
            'release 13.0, V13.0.88"; exit 0;; esac\n' + ptxas_body)
    _script(bin_dir, "fatbinary", fatbinary_body)
    return Toolchain(bin_dir, (13, 0), "13.0.88")


def _aot_with_failing_ptxas(so: Path, home: Path, tmp_path: Path) -> None:
    """The command line's aot of `so` with the toolchain under `home`, whose ptxas fails:
    one line, exit 2; then a moment for the kernel to reap what the run killed."""
    done = subprocess.run(
        [sys.executable, "-m", "sm121_build", "aot", str(so), "--out",
         str(tmp_path / "out"), "--cuda-home", str(home / "bin" / ".."), "--no-cache",
         "--target", "sm_121"], capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 2, done.stderr
    time.sleep(0.3)


def test_ptxas_that_exits_0_and_writes_nothing_is_named(tmp_path: Path) -> None:
    toolchain = _toolchain(tmp_path, "exit 0\n")
    with pytest.raises(ToolchainError, match=r"^ptxas exited 0 and wrote no cubin$"):
        run_ptxas(toolchain, b".version 8.0\n", Compile("sm_121", timeout=30.0))
    with pytest.raises(ToolchainError, match=r"^fatbinary exited 0 and wrote no fatbin$"):
        fatbin_entry(toolchain, b"\x7fELF", "121", 30.0)


def test_ptxas_past_its_limit_is_ended_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    toolchain = _toolchain(tmp_path, f"sleep 600 &\necho $! > {pidfile}\nwait\n")
    started = time.monotonic()
    with pytest.raises(ToolchainError, match="ran past its 1 s limit"):
        run_ptxas(toolchain, b".version 8.0\n", Compile("sm_121", timeout=1.0))
    assert time.monotonic() - started < 5
    time.sleep(0.2)
    assert not _alive(int(pidfile.read_text()))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_ptxas_works_ends_the_run_in_seconds(
        jit_only_so: Path, tmp_path: Path, signum: int) -> None:
    """`aot` with a ptxas that works for ten minutes (through a child of its own, as a shim
    does): the signal ends the run within 2 s, exit 130, one line, no traceback, no ptxas
    left, nothing in the temp folder."""
    pids = tmp_path / "pids"
    pids.mkdir()
    home = tmp_path / "cuda"
    home.mkdir()
    _toolchain(home, f"sleep 600 &\necho $! > {pids}/$$\nwait\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "sm121_build", "--progress", "plain", "aot", str(jit_only_so),
         "--out", str(tmp_path / "out"), "--cuda-home", str(home / "bin" / ".."),
         "--timeout", "3600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for _ in range(600):
        if list(pids.iterdir()):
            break
        time.sleep(0.05)
    assert list(pids.iterdir()), "ptxas never started"
    time.sleep(0.3)
    process.send_signal(signum)
    sent = time.monotonic()
    _, err = process.communicate(timeout=30)
    took = time.monotonic() - sent
    assert process.returncode == 130, err
    assert took < 2.0, f"took {took:.1f} s to end"
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted")
    time.sleep(0.2)
    for pidfile in pids.iterdir():
        assert not _alive(int(pidfile.read_text())), "a ptxas outlived the run"
    assert list(tmp.iterdir()) == []
    assert not (tmp_path / "out").exists()


def test_a_grandchild_holding_stdout_does_not_make_a_finished_program_hang(
        tmp_path: Path) -> None:
    """The program exits at once; a child it left keeps stdout open: its end is its exit,
    not the pipe's closing (red team, issue #54: 'ptxas ran past its limit', untrue)."""
    pidfile = tmp_path / "pid"
    holder = _script(tmp_path, "holder", f"sleep 600 &\necho $! > {pidfile}\necho done\n")
    started = time.monotonic()
    done = run(Program((str(holder),), 60.0, "holder"))
    assert time.monotonic() - started < 5
    assert (done.returncode, done.timed_out, done.stdout) == (0, False, b"done\n")
    time.sleep(0.2)
    assert not _alive(int(pidfile.read_text()))


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
def test_a_grandchild_that_leaves_the_group_is_ended_with_the_run(jit_only_so: Path,
                                                                tmp_path: Path) -> None:
    """A ptxas whose child calls setsid (leaving the group): the command line adopts the
    orphan (subreaper) and ends it; nothing outlives the run."""
    pids = tmp_path / "pids"
    pids.mkdir()
    home = tmp_path / "cuda"
    home.mkdir()
    _toolchain(home, f"setsid sleep 600 >/dev/null 2>&1 < /dev/null &\necho $! > {pids}/$$\n"
               "exit 1\n")
    _aot_with_failing_ptxas(jit_only_so, home, tmp_path)
    left = [int(p.read_text()) for p in pids.iterdir()]
    assert left, "ptxas never ran"
    assert not [pid for pid in left if _alive(pid)], "a setsid'd grandchild outlived the run"


def test_a_tools_output_is_read_no_further_than_a_bound(tmp_path: Path) -> None:
    """A ptxas that writes a 6 GB (sparse) cubin: refused by its size, never read whole."""
    toolchain = _toolchain(tmp_path, 'for a in "$@"; do [ "$prev" = -o ] && out=$a; '
                           'prev=$a; done\ntruncate -s 6G "$out"\nexit 0\n')
    with pytest.raises(ToolchainError, match="ptxas's cubin holds 6442450944 bytes"):
        run_ptxas(toolchain, b".version 8.0\n", Compile("sm_121", timeout=30.0))


def test_a_hanging_version_is_said_as_such(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from sm121_build.cuda import ptxas

    monkeypatch.setattr(ptxas, "VERSION_TIMEOUT", 1.0)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ptxas", "fatbinary"):
        _script(bin_dir, tool, f"sleep 600 &\necho $! > {tmp_path}/{tool}.pid\nwait\n")
    with pytest.raises(ToolchainError, match=r"--version gave no answer in 1 s$"):
        ptxas.find_toolchain(tmp_path)


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
def test_a_daemons_whole_tree_is_ended_with_the_run(jit_only_so: Path, tmp_path: Path) -> None:
    """ptxas starts a setsid'd shell that starts two more; past --timeout every one of them
    ends with the run, generation after generation (red team: one sweep left the second)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    home = tmp_path / "cuda"
    home.mkdir()
    _toolchain(home, f'setsid sh -c "sleep 600 & echo \\$! > {pids}/a; sleep 601 & '
               f'echo \\$! > {pids}/b; wait" >/dev/null 2>&1 < /dev/null &\nsleep 600\n')
    done = subprocess.run(
        [sys.executable, "-m", "sm121_build", "aot", str(jit_only_so), "--out",
         str(tmp_path / "out"), "--cuda-home", str(home / "bin" / ".."), "--no-cache",
         "--target", "sm_121", "--timeout", "2"], capture_output=True, text=True,
        timeout=120, check=False, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "c")})
    assert done.returncode == 2 and "ran past its 2 s limit" in done.stderr, done.stderr
    time.sleep(0.3)
    left = [int(p.read_text()) for p in pids.iterdir()]
    assert len(left) == 2  # (_no_sleeper_left ends them, whatever fails)
    assert not [pid for pid in left if _alive(pid)], "a daemon's child outlived the run"


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize("each_level", [False, True], ids=["one-group", "setsid-each-level"])
def test_a_chain_deeper_than_any_count_of_sweeps_is_ended(jit_only_so: Path, tmp_path: Path,
                                                          each_level: bool) -> None:
    """Red team round 5: ptxas leaves a daemon that nests 300 generations, in one new group
    or in a new session at each level; every one ends with the run (a fixed count of sweeps,
    one generation each, left 37 alive)."""
    chain = tmp_path / "chain.py"
    chain.write_text(
        "import os, time\nos.setsid()\n"
        f"for depth in range(300):\n    if os.fork() != 0:\n"
        "        while True: time.sleep(100)\n"
        f"    {'os.setsid()' if each_level else 'pass'}\n"
        f"    open({str(tmp_path / 'pids')!r} + '/' + str(os.getpid()), 'w').close()\n"
        "while True: time.sleep(100)\n")
    (tmp_path / "pids").mkdir()
    home = tmp_path / "cuda"
    home.mkdir()
    _toolchain(home, f"{sys.executable} {chain} >/dev/null 2>&1 </dev/null &\n"
               f"while [ $(ls {tmp_path / 'pids'} | wc -l) -lt 300 ]; do sleep 0.1; done\n"
               "exit 1\n")
    try:
        _aot_with_failing_ptxas(jit_only_so, home, tmp_path)
        left = [int(p.name) for p in (tmp_path / "pids").iterdir()]
        assert len(left) >= 300  # (ptxas may run once for each module)
        alive = [pid for pid in left if _alive(pid)]
        assert not alive, f"{len(alive)} of a 300-deep chain outlived the run"
    finally:  # never leave a chain (a second module's may still grow) to the machine
        _end_every_process_naming(str(chain))


def test_a_protocol_never_reads_the_tail_of_a_cut_line_as_a_line() -> None:
    """Red team round 6: 64 KiB of noise then a JSON object, on one line: the tail after the
    cut was handed on as a line of its own, and a child's forged answer was trusted.  With
    `on_cut`, the whole cut line is reported as cut and nothing of it is handed on; a log
    (no `on_cut`) still goes on after the cut."""
    from sm121_build.core.children import Lines

    said: list[str] = []
    cuts: list[int] = []
    protocol = Lines(said.append, 16, on_cut=lambda: cuts.append(1))
    for chunk in (b'{"a": 1}\n', b"x" * 10, b"y" * 10 + b'{"forged": 1}', b"\n",
                  b'{"b": 2}\n', b"z" * 40):
        protocol(chunk)
    protocol.close()
    assert said == ['{"a": 1}\n', '{"b": 2}\n'] and len(cuts) == 2
    log: list[str] = []
    follows = Lines(log.append, 16)
    follows(b"x" * 20 + b"tail\n")
    assert log == ["x" * 16, "xxxxtail\n"]
