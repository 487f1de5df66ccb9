"""aot's schedule (`cuda/ptxas_schedule`): costliest first, every core busy while work is
left, a module that would set the wall split across the cores that would idle, never more
threads than cores nor more memory than given (a module alone aside)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sm121_build.cuda.ptxas_schedule import (
    MAX_THREADS,
    MIN_SPLIT_SECONDS,
    PtxTask,
    Schedule,
    Start,
    peak_memory,
)

GB = 1 << 30


def _simulate(schedule: Schedule, speedup: float = 0.7) -> tuple[float, list[Start]]:
    """Run the schedule on a simulated clock: a job on T threads takes cost / (1 + (T - 1) *
    speedup) seconds.  The wall clock, and every start in order."""
    now, ends, starts = 0.0, {}, []
    while schedule.pending or schedule.running:
        for start in schedule.starts():
            assert schedule.free_cores >= 0, "more threads than cores"
            used = schedule.memory - schedule.free_memory
            assert used <= schedule.memory or len(schedule.running) == 1, "memory overrun"
            job = schedule.jobs[start.index]
            ends[start.index] = now + job.cost / (1 + (start.threads - 1) * speedup)
            starts.append(start)
        assert schedule.running, "nothing runs while jobs wait"
        index = min(schedule.running, key=lambda i: ends[i])
        now = ends.pop(index)
        schedule.finished(index)
    return now, starts


def test_the_module_that_sets_the_wall_is_split_and_the_rest_are_not() -> None:
    # vLLM 0.33.0's x86_64 `_C` on 16 cores: one 294 CPU-s module among small ones
    jobs = (PtxTask(294.0, 33700000), *tuple(PtxTask(12.0, 1000000) for _ in range(30)))
    plain, _ = _simulate(Schedule(jobs, 16, 64 * GB, split=False))
    split, starts = _simulate(Schedule(jobs, 16, 64 * GB))
    assert plain == 294.0  # the slowest module is the wall
    assert starts[0].index == 0 and starts[0].threads > 1
    assert all(s.threads == 1 for s in starts if jobs[s.index].cost < MIN_SPLIT_SECONDS)
    assert split < plain / 2


def test_many_equal_modules_keep_one_thread_each() -> None:
    jobs = tuple(PtxTask(30.0, 2_000_000) for _ in range(64))  # FA2-like: 64 modules, 16 cores
    wall, starts = _simulate(Schedule(jobs, 16, 64 * GB))
    assert all(s.threads == 1 for s in starts[:48])  # the tail may split, the bulk never
    assert wall <= 4 * 30.0 + 1e-9


def test_a_split_never_takes_more_memory_than_given() -> None:
    job = PtxTask(300.0, 33_700_000)
    fits_two = peak_memory(job.size, 2) + 1
    schedule = Schedule((job,), 16, fits_two)
    (start,) = schedule.starts()
    assert start.threads == 2


def test_a_module_that_fits_nowhere_waits_then_runs_alone() -> None:
    big, small = PtxTask(100.0, 40_000_000), PtxTask(5.0, 1_000)
    schedule = Schedule((big, small), 4, peak_memory(big.size, 1) - 1)
    first = schedule.starts()
    assert [s.index for s in first] == [0]  # alone: nothing else runs, so it starts anyway
    schedule.finished(0)
    assert [s.index for s in schedule.starts()] == [1]


@settings(max_examples=80, deadline=None)
@given(costs=st.lists(st.floats(0.1, 600.0), min_size=1, max_size=40),
       cores=st.integers(1, 24), memory_gb=st.integers(1, 128))
def test_any_schedule_starts_each_module_once_within_the_cores(
        costs: list[float], cores: int, memory_gb: int) -> None:
    jobs = tuple(PtxTask(c, int(c * 100_000)) for c in costs)
    schedule = Schedule(jobs, cores, memory_gb * GB)
    wall, starts = _simulate(schedule)
    assert sorted(s.index for s in starts) == list(range(len(jobs)))
    assert all(1 <= s.threads <= min(cores, MAX_THREADS) for s in starts)
    if schedule.memory >= peak_memory(sum(j.size for j in jobs), MAX_THREADS):
        # memory never binds: never worse than the floor by more than a list schedule (2x)
        assert wall <= 2 * max(sum(costs) / cores, max(costs)) + 1e-6
    # the costliest of the jobs that started first is never passed over by a cheaper one
    first = starts[0].index
    assert jobs[first].cost == max(costs)
