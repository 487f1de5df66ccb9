"""Which PTX module ptxas compiles next, and on how many threads: the wall clock's floor.

aot is ptxas-bound: its wall clock is at least the larger of (CPU-seconds ÷ cores) and the
slowest single module.  Modules start largest (by estimated CPU cost) first, one thread
each while there are enough of them to keep every core busy.  A module whose cost is more
than its share of the work left (the CPU-seconds left ÷ the cores) would set the wall on
its own: it gets ptxas's `--split-compile` threads, about cost ÷ share of them, so it ends
with the rest.  Measured on the lent machine (16 vCPUs, ptxas 13.0, 2026-11-26, each module
alone; docs/measurements.md): vLLM 0.33.0's 33.7 MB CUTLASS module of `_C` takes 330 s
plain, 98 s on 4 threads, 46 s on 15 (317 and 386 CPU-s); FA2's 22.4 MB module 108 s, 35 s,
20 s; every `.text` section the same.  Split compiles take more memory: 1.6 GiB plain,
3.6 GiB on 4 threads, 4.3 GiB on 15 for the `_C` module (0.86, 1.9, 3.4 GiB for FA2's), so
a start must fit the memory left; a module that fits nowhere runs alone.

Pure bookkeeping: no processes, no clock.  `jobs/aot_work/aot_compile.py` runs what it says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# peak memory of ptxas per byte of PTX (plain: 1.6 GiB for 33.7 MB), and how it grows with
# threads: x(1 + 0.45 per further thread), at most x4 (measured: x2.2-2.3 on 4 threads,
# x2.7-4.0 on 15, vLLM 0.33.0's largest modules)
MEMORY_PER_PTX_BYTE = 52.0
MEMORY_GROWTH_PER_THREAD = 0.45
MEMORY_GROWTH_CAP = 4.0
MIN_SPLIT_SECONDS = 20.0  # a module this cheap is never split: threads cost more than they save
MAX_THREADS = 16  # ptxas gains little past this (its optimiser's parallel share)


@dataclass(frozen=True)
class PtxTask:
    """One module to compile: its estimated CPU-seconds and its PTX size."""

    cost: float
    size: int


@dataclass(frozen=True)
class Start:
    """Start job `index` on `threads` threads (1: a plain ptxas)."""

    index: int
    threads: int


def peak_memory(size: int, threads: int) -> int:
    """The memory ptxas is expected to take for `size` bytes of PTX on `threads` threads."""
    growth = min(1 + MEMORY_GROWTH_PER_THREAD * (threads - 1), MEMORY_GROWTH_CAP)
    return int(size * MEMORY_PER_PTX_BYTE * growth)


@dataclass
class Schedule:
    """The jobs not started yet (largest first), the cores and memory free now."""

    jobs: tuple[PtxTask, ...]
    cores: int
    memory: int  # bytes ptxas may take in all
    split: bool = True
    pending: list[int] = field(default_factory=list)
    running: dict[int, Start] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cores = max(1, self.cores)
        self.pending = sorted(range(len(self.jobs)), key=lambda i: (-self.jobs[i].cost, i))

    @property
    def free_cores(self) -> int:
        return self.cores - sum(s.threads for s in self.running.values())

    @property
    def free_memory(self) -> int:
        used = sum(peak_memory(self.jobs[i].size, s.threads) for i, s in self.running.items())
        return self.memory - used

    def left(self) -> float:
        """CPU-seconds not started yet, and of the jobs running (whole: a bound)."""
        return sum(self.jobs[i].cost for i in self.pending) + \
            sum(self.jobs[i].cost for i in self.running)

    def starts(self) -> list[Start]:
        """What to start now: the largest pending jobs while cores (and memory) are free."""
        started = []
        while self.pending and self.free_cores > 0:
            index = self.pending[0]
            threads = self._threads(index)
            if threads == 0:
                break  # no memory for it until something ends
            self.pending.pop(0)
            start = Start(index, threads)
            self.running[index] = start
            started.append(start)
        return started

    def finished(self, index: int) -> None:
        del self.running[index]

    def _threads(self, index: int) -> int:
        """Threads for the job: its share of the work left, within the free cores and
        memory; 0 when it fits in neither and other jobs run (it waits for them)."""
        job = self.jobs[index]
        wanted = 1
        if self.split and job.cost >= MIN_SPLIT_SECONDS:
            share = self.left() / self.cores  # what each core has left to do
            wanted = max(1, math.ceil(job.cost / share)) if share > 0 else 1
        threads = max(1, min(wanted, self.free_cores, MAX_THREADS))
        while threads > 1 and peak_memory(job.size, threads) > self.free_memory:
            threads -= 1
        if peak_memory(job.size, threads) > self.free_memory and self.running:
            return 0
        return threads

    def floor(self) -> float:
        """The wall clock no schedule beats, in CPU-seconds of one core: the work over the
        cores, or the costliest job on one thread when it cannot be split."""
        costs = [j.cost for j in self.jobs]
        total = sum(costs)
        largest = max(costs, default=0.0)
        return max(total / self.cores, largest / (MAX_THREADS if self.split else 1))
