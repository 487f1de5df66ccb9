"""aot's compile loop: modules started as `cuda/ptxas_schedule` says, a live line from the
first second, and the machine's pace against the table of measured costs kept for the next
run's estimates.

The line speaks at once and again while ptxas works in silence (a 33.7 MB CUTLASS module is
minutes of one process saying nothing): the share of the estimated CPU work done, what runs,
and a time left from the estimated CPU-seconds left (scaled by this run's measured pace so
far) over the cores, never less than the longest module still running needs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from sm121_build.core.console import LiveLine, end_status_line
from sm121_build.core.errors import ToolchainError
from sm121_build.core.inputs import InputRefused, read_input
from sm121_build.core.paths import state_dir, store_bytes
from sm121_build.core.units import duration
from sm121_build.cuda.ptxas_cost import Estimate
from sm121_build.cuda.ptxas_schedule import PtxTask, Schedule, Start

MEMORY_SHARE = 0.7  # of the machine's memory, what ptxas processes may take in all
TICK = 1.0  # seconds between looks at the line while nothing ends
MIN_PACE_SECONDS = 30.0  # measured CPU-seconds behind a pace worth keeping
PACE_FILE = "aot-pace.json"


@dataclass(frozen=True)
class Compiled:
    """A module's cubin and fatbin entry, and the CPU-seconds ptxas took (0: from cache)."""

    cubin: bytes
    entry: bytes
    cpu_seconds: float


@dataclass(frozen=True)
class CompileInputs:
    """The modules' estimates (`ptxas_cost`), the cores, whether modules may be split, the
    pace of this machine against the table, and ptxas's version (whose pace it is)."""

    costs: tuple[Estimate, ...]
    sizes: tuple[int, ...]
    cores: int
    split: bool = True
    pace: float = 1.0
    ptxas: str = ""  # its version: a pace is kept per ptxas


@dataclass
class _Tally:
    """What is known while the loop runs: modules done, their measured and predicted
    CPU-seconds (compiled ones only: a cache hit measures nothing)."""

    done: int = 0
    done_cost: float = 0.0
    measured: float = 0.0
    predicted: float = 0.0
    started: float = field(default_factory=time.monotonic)
    since: dict[int, float] = field(default_factory=dict)  # running module -> its start

    def pace(self, prior: float) -> float:
        """Measured over predicted CPU-seconds so far, once enough is behind it."""
        if self.measured >= MIN_PACE_SECONDS and self.predicted > 0:
            return self.measured / self.predicted
        return prior


def machine_memory() -> int:
    """The bytes ptxas processes may take in all: a share of the machine's memory."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 16 << 30
    return int(total * MEMORY_SHARE)


def compile_all(inputs: CompileInputs, work: Callable[[int, int], Compiled],
                ) -> Iterator[tuple[int, Compiled | ToolchainError]]:
    """Each module's index with its result (or its ptxas error), as they end; `work(index,
    threads)` compiles one."""
    jobs = tuple(PtxTask(c.cpu_seconds, s) for c, s in zip(inputs.costs, inputs.sizes, strict=True))
    schedule = Schedule(jobs, inputs.cores, machine_memory(), inputs.split)
    tally = _Tally()
    line = LiveLine(every=30.0, gap=0.2)
    first = True
    with ThreadPoolExecutor(inputs.cores) as pool:
        running: dict[Future[Compiled], Start] = {}
        try:
            while schedule.pending or running:
                for start in schedule.starts():
                    tally.since[start.index] = time.monotonic()
                    running[pool.submit(work, start.index, start.threads)] = start
                if first:  # the line from the first second, and again while ptxas works
                    line.say(_text(inputs, schedule, tally))
                    first = False
                elif line.due():  # said with what runs now, never between an end and a start
                    line.say(_text(inputs, schedule, tally))
                finished, _ = wait(running, timeout=TICK, return_when=FIRST_COMPLETED)
                for future in finished:
                    start = running.pop(future)
                    schedule.finished(start.index)
                    del tally.since[start.index]
                    yield start.index, _outcome(future, inputs, start.index, tally)
        finally:
            for future in running:
                future.cancel()
            end_status_line()
    if tally.measured >= MIN_PACE_SECONDS and tally.predicted > 0:
        keep_pace(inputs.ptxas, tally.measured / tally.predicted)


def _outcome(future: Future[Compiled], inputs: CompileInputs, index: int,
             tally: _Tally) -> Compiled | ToolchainError:
    tally.done += 1
    tally.done_cost += inputs.costs[index].cpu_seconds
    try:
        compiled = future.result()
    except ToolchainError as exc:
        return exc
    if compiled.cpu_seconds > 0:
        tally.measured += compiled.cpu_seconds
        tally.predicted += inputs.costs[index].cpu_seconds
    return compiled


def _text(inputs: CompileInputs, schedule: Schedule, tally: _Tally) -> str:
    total = sum(c.cpu_seconds for c in inputs.costs) or 1.0
    elapsed = time.monotonic() - tally.started
    threads = sum(s.threads for s in schedule.running.values())
    return (f"aot [{tally.done}/{len(inputs.costs)}] {100 * tally.done_cost / total:.0f}% of the"
            f" estimated work, {len(schedule.running)} module(s) on {threads} thread(s), "
            f"{duration(elapsed)}; about {duration(_left(inputs, schedule, tally))} left")


def _left(inputs: CompileInputs, schedule: Schedule, tally: _Tally) -> float:
    """Seconds left: the CPU-seconds left (this run's pace) over the cores, and at least
    what the slowest running module still needs on its threads."""
    pace = tally.pace(inputs.pace)
    now = time.monotonic()
    left = sum(inputs.costs[i].cpu_seconds for i in schedule.pending) * pace
    slowest = 0.0
    for index, start in schedule.running.items():
        spent = (now - tally.since.get(index, now)) * start.threads
        rest = max(inputs.costs[index].cpu_seconds * pace - spent, 0.0)
        left += rest
        slowest = max(slowest, rest / start.threads)
    return max(left / max(inputs.cores, 1), slowest)


def kept_pace(version: str) -> float:
    """This machine's pace against the table (measured / predicted CPU-seconds), as the
    last aot with this ptxas found it; 1.0 when none was kept."""
    try:
        raw = json.loads(read_input(state_dir() / PACE_FILE, 4096, "aot pace"))
        pace = float(raw["pace"]) if raw.get("ptxas") == version else 1.0
    except (InputRefused, OSError, ValueError, KeyError, TypeError, AttributeError):
        return 1.0
    return pace if 0.05 <= pace <= 20 else 1.0


def keep_pace(version: str, pace: float) -> None:
    """Keep this run's pace for the next run's estimates (the state folder, one small JSON file)."""
    store_bytes(state_dir() / PACE_FILE,
                json.dumps({"pace": round(pace, 3), "ptxas": version}).encode())
