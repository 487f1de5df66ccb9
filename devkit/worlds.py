"""A fuzzer of whole runs: a generated hostile world (files of every kind and name, links,
FIFOs, odd modes, escapes in names; cache and state folders planted or unwritable; a fake
ptxas that hangs, floods, lies, dies or forks) × a command × generated option values × a
signal at a random moment, with the invariants every run must keep checked on each:

- no traceback, and an exit code from the documented table;
- no input, unrelated file or engine image changed; nothing written outside the results
  the command was given (`--out`, `--summary-md`), and none of those half-written;
- no raw control character in what a person reads (stdout and stderr);
- the run ends within its time bound (a signal: within 2 s), within its memory bound;
- no program it started, and nothing in its temp folder, left behind.

`tests/unit/test_whole_runs.py` draws the worlds with hypothesis (a fixed budget in CI);
`python -m devkit.worlds --runs N [--seed S]` runs N random ones (the nightly) and prints
each broken invariant with the world that broke it, which then becomes a seed of the test.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from devkit.hostile import nested_rodata

EXITS = frozenset({0, 1, 2, 3, 4, 5, 6, 7, 130})  # README's table (test_exit_codes checks it)
RUN_S = 25.0  # one run, without a signal (a quadratic search of a `nested` file: minutes)
SIGNAL_S = 2.0  # from the signal to the end
MAX_RSS = 500 << 20
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

# names a world's files may have: plain, spaced, escapes, newline, bidi, Markdown, unicode
FORGED = "fake: all native"  # a line that begins so was forged by a name (below)
NAMES = ("k.so", "a b.so", "k\x1b]0;x\x07.so", "k\x1b[2J.so", "l\nfake: all native.so",
         "\u202egpj.so", "t|`x`[l](u).so", "ü✓.so", "-rf.so", ".hidden.so", "k.so.1")
KINDS = ("elf", "jit", "truncated", "empty", "noise", "fifo", "link_out", "link_loop",
         "link_dangling", "dir", "mode000", "wheel", "wheel_dup", "wheel_nameless",
         "wheel_dot", "wheel_norecord", "tar", "nested")
BAD_WHEELS = frozenset({"wheel_dup", "wheel_nameless", "wheel_dot"})  # the one rule refuses
PTXAS = ("real", "hang", "flood", "lie", "die", "fork", "none")
PLANTS = ("none", "cache_ledger", "cache_link", "state_unwritable", "cache_file")
COMMANDS = ("audit", "audit_json", "audit_md", "audit_file", "aot", "aot_file")
TIMEOUTS = ("2", "1", "600", "inf", "nan", "-1", "0", "", "1e300", "x", "3601e9")
TARGETS = (None, "sm_121", "sm_90", "", "sm_999", "sm_12", "compute_121", "sm_121a")
BAD_TIMEOUTS = frozenset(TIMEOUTS) - {"2", "1", "600"}
BAD_TARGETS = frozenset({"", "sm_999", "sm_12"})


@dataclass(frozen=True)
class World:
    """One run to try: what lies in the folder, the tools, the planted state, the command,
    its option values, and the signal (None: none) with its delay."""

    files: tuple[tuple[str, str], ...]  # (kind, name)
    ptxas: str
    plant: str
    command: str
    timeout: str
    target: str | None
    signum: int | None
    delay: float


class Signalled(Protocol):
    """A world of any family: the signal it sends (None: none) and after how long."""

    @property
    def signum(self) -> int | None: ...
    @property
    def delay(self) -> float: ...


@dataclass
class Outcome:
    """What a run did, and the invariants it broke (empty: none)."""

    world: Signalled
    code: int
    seconds: float
    broken: list[str] = field(default_factory=list)
    said: str = ""  # its stderr


def random_world(rng: random.Random) -> World:
    files = tuple((rng.choice(KINDS), rng.choice(NAMES)) for _ in range(rng.randint(0, 5)))
    return World(files, rng.choice(PTXAS), rng.choice(PLANTS), rng.choice(COMMANDS),
                 rng.choice(TIMEOUTS), rng.choice(TARGETS),
                 rng.choice((None, None, signal.SIGINT, signal.SIGTERM)),
                 round(rng.uniform(0.05, 1.5), 2))


@dataclass(frozen=True)
class Seeds:
    """Real device code the worlds copy: a .so with cubins and PTX, and a JIT-only one."""

    elf: Path
    jit: Path
    cuda_home: Path | None  # the real toolkit (ptxas "real"), when there is one


def _fake_ptxas(folder: Path, how: str, pids: Path) -> Path:
    """A CUDA home whose ptxas answers --version as 13.0's and then behaves as `how` says;
    every process it starts records its pid under `pids`."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    body = {
        "hang": "sleep 600 &\necho $! > \"$P/$!\"\nwait\n",
        "flood": "yes 'ptxas flood line'\n",
        "lie": "exit 0\n",
        "die": "kill -9 $$\n",
        "fork": "(sleep 600 >/dev/null 2>&1 &\necho $! > \"$P/fork$$\")\nexit 0\n",
    }[how]
    script = (f"#!/bin/sh\nP='{pids}'\necho $$ > \"$P/$$\"\n"
              'case "$1" in --version) echo "Cuda compilation tools, release 13.0, '
              'V13.0.88"; exit 0;; esac\n' + body)
    for tool in ("ptxas", "fatbinary"):
        (bin_dir / tool).write_text(script)
        (bin_dir / tool).chmod(0o755)
    return folder


def _wheel(path: Path, elf: bytes, how: str) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel, warnings_off():
        wheel.writestr("pkg/_k.so", elf)
        if how == "wheel_dup":
            wheel.writestr("pkg/_k.so", elf[:100])
        if how == "wheel_dot":
            wheel.writestr("pkg/./_k.so", elf[:200])
        if how == "wheel_nameless":
            wheel.writestr(zipfile.ZipInfo(""), b"x")
        if how != "wheel_norecord":
            wheel.writestr("pkg-1.0.dist-info/RECORD", "pkg/__init__.py,,\n")
    path.write_bytes(buffer.getvalue())


@contextlib.contextmanager
def warnings_off() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _path(folder: Path, kind: str, name: str) -> Path:
    """Where a file of the world goes: a wheel named as PEP 427 names one (`k.so-1.0-py3-
    none-any.whl`; a name pip would not take, one with a newline, is refused by the one
    rule), a tarball `NAME.tar`, anything else by its name."""
    return folder / (name + "-1.0-py3-none-any.whl" if kind.startswith("wheel") else
                     name + ".tar" if kind == "tar" else name)


def _place(folder: Path, kind: str, name: str, seeds: Seeds, outside: Path) -> Path | None:
    """One file of the world, its path (a name already there: this one is left out, None)."""
    path = _path(folder, kind, name)
    if os.path.lexists(path):
        return None
    elf = seeds.elf.read_bytes()
    if kind == "elf":
        path.write_bytes(elf)
    elif kind == "jit":
        path.write_bytes(seeds.jit.read_bytes())
    elif kind == "truncated":
        path.write_bytes(elf[: len(elf) // 3])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "noise":
        path.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 4)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link_out":
        path.symlink_to(outside)
    elif kind == "link_loop":
        path.symlink_to(path.name)
    elif kind == "link_dangling":
        path.symlink_to(folder / "nowhere")
    elif kind == "dir":
        path.mkdir()
        (path / "inner.so").write_bytes(elf)
    elif kind == "mode000":
        path.write_bytes(elf)
        path.chmod(0)
    elif kind.startswith("wheel"):
        _wheel(path, elf, kind)
    elif kind == "tar":
        path.write_bytes(b"not a tarball" * 100)
    elif kind == "nested":
        path.write_bytes(nested_rodata(8000))  # 640 KB: 92 s when searched quadratically
    return path


def _plant(home: Path, plant: str, outside: Path) -> None:
    cache, state = home / "cache" / "sm121-build", home / "state"
    if plant == "cache_ledger":
        cache.mkdir(parents=True)
        (cache / "ledger.json").write_text(
            '{"images": [{"id": "sha256:' + "0" * 64 + '", "tag": "x:y"}]}')
    elif plant == "cache_link":
        cache.mkdir(parents=True)
        (cache / "aot").symlink_to(outside)
    elif plant == "state_unwritable":
        state.mkdir(parents=True)
        (state / "sm121-build").write_text("a file where the state folder should be")
    elif plant == "cache_file":
        (home / "cache").mkdir(parents=True)
        cache.write_text("a file where the cache folder should be")


def snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[object, ...]]:
    """Every path below `root` (links not followed): its type, mode and content hash."""
    seen: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            if any(path == s or s in path.parents for s in skip):
                continue
            info = path.lstat()
            digest: object = None
            if stat.S_ISLNK(info.st_mode):
                digest = os.readlink(path)
            elif stat.S_ISREG(info.st_mode) and info.st_mode & 0o444:
                with contextlib.suppress(OSError):
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()
            seen[str(path.relative_to(root))] = (stat.S_IFMT(info.st_mode),
                                                 stat.S_IMODE(info.st_mode), digest)
    return seen


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X")


def _first(world: World, folder: Path) -> tuple[str, Path]:
    """The kind and path of the world's first regular file (the `_file` commands' input),
    or the folder."""
    for kind, name in world.files:
        path = _path(folder, kind, name)
        if path.is_file() and not path.is_symlink():
            return kind, path
    return "folder", folder


def _args(world: World, folder: Path, out: Path, summary: Path,
          cuda_home: Path | None) -> list[str]:
    first = _first(world, folder)[1]
    target = [] if world.target is None else ["--target", world.target]
    if world.command.startswith("audit"):
        what = first if world.command == "audit_file" else folder
        extra = {"audit_json": ["--json"], "audit_md": ["--summary-md", str(summary)]}
        return ["audit", str(what), "--kernels", *target, *extra.get(world.command, [])]
    what = first if world.command == "aot_file" else folder
    home = [] if cuda_home is None else ["--cuda-home", str(cuda_home)]
    return ["aot", str(what), "--out", str(out), "--timeout", world.timeout, *target, *home,
            "-j", "2"]


def run_world(world: World, seeds: Seeds, root: Path) -> Outcome:
    """Make the world under `root`, run the command in it, check every invariant."""
    folder, outside, home = root / "in", root / "outside", root / "home"
    tmp, pids, out, summary = root / "tmp", root / "pids", root / "out", root / "summary.md"
    for made in (folder, outside, home, tmp, pids):
        made.mkdir()
    (outside / "victim.so").write_bytes(b"unrelated")
    for kind, name in world.files:
        _place(folder, kind, name, seeds, outside / "victim.so")  # (its path: `_first`)
    _plant(home, world.plant, outside)
    cuda_home: Path | None = None
    if world.ptxas == "real":
        cuda_home = seeds.cuda_home
    elif world.ptxas != "none":
        cuda_home = _fake_ptxas(root / "cuda", world.ptxas, pids)
    env = {**os.environ, "TMPDIR": str(tmp), "XDG_CACHE_HOME": str(home / "cache"),
           "XDG_STATE_HOME": str(home / "state"), "HOME": str(home), "COLUMNS": "120",
           "PATH": "/usr/bin:/bin"}
    env.pop("CUDA_HOME", None)
    before = snapshot(root, (tmp, pids, out, summary, home))
    outcome = _run(world, _args(world, folder, out, summary, cuda_home), env)
    _check_world(outcome, root, before, (tmp, pids, out, summary, home))
    if refused_at_the_edge(world) and world.signum is None and (
            outcome.code != 2 or list(pids.iterdir()) or out.exists()):
        outcome.broken.append(f"a bad value was not refused before any work (exit "
                              f"{outcome.code})")
    kind, _path = _first(world, folder)
    if world.command.endswith("_file") and kind in BAD_WHEELS and world.signum is None \
            and not refused_at_the_edge(world) and (
                outcome.code != 2 or "not a wheel pip would install" not in outcome.said):
        outcome.broken.append(f"a {kind} wheel was not refused by the one rule (exit "
                              f"{outcome.code})")
    return outcome


def refused_at_the_edge(world: World) -> bool:
    """Whether the world gives a value every command must refuse before any work."""
    return world.target in BAD_TARGETS or (world.command.startswith("aot")
                                           and world.timeout in BAD_TIMEOUTS)


def _run(world: Signalled, args: list[str], env: dict[str, str], limit: float = RUN_S,
         bound: float | None = None, ready: threading.Event | None = None) -> Outcome:
    """Run the CLI with `args`, send the world's signal, check the invariants of any run:
    killed past `limit` s; `bound`: the seconds a run without a signal may take (its
    address space is then capped at four times the memory bound, so a run that reads
    without end fails instead of exhausting this machine); `ready`: the signal is sent
    `world.delay` s after it is set (a FAKE engine that stalled), not after the start."""
    # Popen reaps the children earlier tests left unwaited (subprocess's `_cleanup`) as it
    # starts this one: reaped here first, their peaks are counted before, not charged to
    # this run (a 556 MiB child of another test once was)
    getattr(subprocess, "_cleanup", lambda: None)()
    peak_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "sm121_build", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                               start_new_session=True)
    if bound is not None:
        with contextlib.suppress(OSError):
            resource.prlimit(process.pid, resource.RLIMIT_AS, (4 * MAX_RSS + (1 << 30),) * 2)
    sent = None
    try:
        if world.signum is not None:
            tool_started(process.pid)
            if ready is not None:
                ready.wait(limit / 2)
            try:
                process.wait(world.delay)
            except subprocess.TimeoutExpired:
                process.send_signal(world.signum)
                sent = time.monotonic()
        stdout, stderr = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return Outcome(world, -1, time.monotonic() - started, [f"ran past {limit:g} s"],
                       said=stderr.decode("utf-8", "replace")[-300:])
    ended = time.monotonic()
    outcome = Outcome(world, process.returncode, ended - started,
                      said=stderr.decode("utf-8", "replace"))
    text = stdout.decode("utf-8", "replace") + stderr.decode("utf-8", "replace")
    if "Traceback" in text:
        outcome.broken.append("a traceback: " + text[-600:])
    if process.returncode not in EXITS:
        outcome.broken.append(f"exit {process.returncode}: not in the table: {text[-300:]}")
    if RAW.search(text):
        found = RAW.search(text)
        assert found is not None
        outcome.broken.append(f"a raw control character {found.group()!r} in: "
                              f"{text[max(found.start() - 80, 0):found.end() + 80]!r}")
    forged = [line for line in text.splitlines() if line.startswith(FORGED)]
    if forged:  # a name's newline began a line of its own (NAMES)
        outcome.broken.append(f"a forged line: {forged[0]!r}")
    if bound is not None and sent is None and ended - started > bound:
        outcome.broken.append(f"{ended - started:.1f} s, over the {bound:g} s bound")
    if sent is not None and ended - sent > SIGNAL_S and process.returncode == 130:
        outcome.broken.append(f"{ended - sent:.1f} s from the signal to the end")
    if process.returncode == 130 and "interrupted" not in stderr.decode("utf-8", "replace"):
        outcome.broken.append("exit 130 without the line that says it was interrupted")
    # getrusage keeps the largest child's peak of this whole process (a test runner's
    # earlier children too): a run broke the bound when it raised that past the bound
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if peak > max(MAX_RSS, peak_before):
        outcome.broken.append(f"peak memory {peak >> 20} MiB")
    return outcome


def tool_started(pid: int, seconds: float = 20.0) -> None:
    """Wait until the process runs the tool's own code: its entry module holds SIGTERM
    (blocked) and the command then handles it (caught); before that is the interpreter's
    start, whose default handling of a signal is not the tool's (docs/security.md)."""
    sigterm = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return  # it has ended already
        masks = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if (int(masks.get("SigBlk", "0"), 16) | int(masks.get("SigCgt", "0"), 16)) & sigterm:
            return
        time.sleep(0.002)


def _check_world(outcome: Outcome, root: Path, before: dict[str, tuple[object, ...]],
                 results: tuple[Path, ...]) -> None:
    tmp, pids, out, summary, _home = results
    after = snapshot(root, results)
    changed = sorted(set(before.items()) ^ set(after.items()))
    if changed:
        outcome.broken.append(f"inputs or unrelated files changed: {changed[:4]}")
    left = list(tmp.iterdir())
    if left:
        outcome.broken.append(f"left in the temp folder: {left[:4]}")
    time.sleep(0.1)
    for record in pids.iterdir():
        with contextlib.suppress(ValueError, OSError):
            pid = int(record.read_text())
            if _alive(pid):
                outcome.broken.append(f"a program it started is still running (pid {pid})")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    for result in (out, summary):
        for path in ([result] if result.is_file() else
                     [p for p in result.rglob("*") if p.is_file()] if result.is_dir() else []):
            if path.name.startswith(".") and ".tmp" in path.name:
                outcome.broken.append(f"a half-written result: {path}")
    if outcome.code == 0 and summary.exists():
        rows = [line for line in summary.read_text().splitlines() if line.startswith("|")]
        if any(len(re.findall(r"(?<!\\)\|", row)) != 7 for row in rows):
            outcome.broken.append("a --summary-md table row with a cell too many or few")


def fresh_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="sm121-world-"))


def remove_root(root: Path) -> None:
    for dirpath, _dirnames, _filenames in os.walk(root):
        with contextlib.suppress(OSError):
            os.chmod(dirpath, 0o755)
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            if not path.is_symlink():
                path.chmod(0o755)
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--family", choices=("files", "registry", "ci"), default="files",
                        help="hostile files and tools (default), a hostile registry "
                             "(devkit/registry_worlds.py), or a hostile machine for "
                             ".ci/system (devkit/ci_worlds.py)")
    args = parser.parse_args()
    if args.family == "ci":
        from devkit.ci_worlds import run_ci_family

        broken = run_ci_family(args.runs, random.Random(args.seed))
        print(f"{args.runs} runs, {broken} broke an invariant")
        sys.exit(1 if broken else 0)
    if args.family == "registry":
        from devkit.registry_worlds import run_registry_family

        broken = run_registry_family(args.runs, random.Random(args.seed))
        print(f"{args.runs} runs, {broken} broke an invariant")
        sys.exit(1 if broken else 0)
    from devkit.helpers import DATA, compile_cached, cuda_home, gencode, link_cached

    seeds = Seeds(
        compile_cached("plain", DATA / "kernels.cu",
                       [*gencode("compute_90:sm_90", "compute_121:sm_121",
                                 "compute_90:compute_90")]),
        link_cached("aot_two", [(DATA / "two_tus" / "a.cu", [
            *gencode("compute_80:sm_80", "compute_80:compute_80")])]),
        cuda_home())
    rng = random.Random(args.seed)
    broken = 0
    for i in range(args.runs):
        world = random_world(rng)
        root = fresh_root()
        try:
            outcome = run_world(world, seeds, root)
        finally:
            remove_root(root)
        if outcome.broken:
            broken += 1
            print(f"run {i}: {world}\n  " + "\n  ".join(outcome.broken), flush=True)
    print(f"{args.runs} runs, {broken} broke an invariant")
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
