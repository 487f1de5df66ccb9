"""Every parser of outside bytes, fed mutations of real seeds (`devkit/fuzz.py`): each input
ends in a result or one error of its class, within the memory and time bounds.

CI runs a fixed, derandomized budget per target (the same inputs each run);
`SM121_FUZZ_EXAMPLES=5000 SM121_FUZZ_RANDOM=1 pytest tests/unit/test_fuzz.py` is a longer,
new run; `python -m devkit.fuzz TARGET` the coverage-guided one (docs/fuzzing.md).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devkit import fuzz
from devkit.helpers import EMULATED, EMULATED_WHY

EXAMPLES = int(os.environ.get("SM121_FUZZ_EXAMPLES", "120"))
RANDOM = os.environ.get("SM121_FUZZ_RANDOM") == "1"
OPERATIONS = ("u8", "u16", "u32", "u64", "u32", "u64", "truncate", "zeros", "splice")


@cache
def _seeds(name: str) -> tuple[tuple[bytes, tuple[int, ...]], ...]:
    return tuple((seed, tuple(fuzz.hot_offsets(seed)))
                 for seed in fuzz.seeds(name, fuzz.fixture_files()))


@st.composite
def _inputs(draw: st.DrawFn, name: str) -> bytes:
    seeds = _seeds(name)
    seed, hot = draw(st.sampled_from(seeds))
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        operation = draw(st.sampled_from(OPERATIONS))
        offset = draw(st.sampled_from(hot)) if hot and draw(st.booleans()) else \
            draw(st.integers(0, max(len(seed) - 1, 0)))
        value = draw(st.one_of(st.sampled_from(fuzz.BOUNDARY), st.integers(0, 1 << 20),
                               st.integers(0, len(seed) + 64)))
        other = draw(st.sampled_from(seeds))[0]
        steps.append((operation, offset, value, other))
    return fuzz.mutate(seed, steps)


@pytest.mark.parametrize("name", sorted(fuzz.TARGETS))
def test_every_seed_is_read_without_a_crash(name: str) -> None:
    """The seeds themselves (real files and the regressions) end as designed: the fuzzer
    would otherwise report the seed, not a mutation."""
    for seed, _hot in _seeds(name):
        outcome = fuzz.run_one(name, seed)
        assert outcome.crash is None and not outcome.broke, (name, outcome)


@pytest.mark.parametrize("name", sorted(fuzz.TARGETS))
def test_mutated_inputs_end_in_a_result_or_one_error_of_their_class(name: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_inputs(name))
    def one(data: bytes) -> None:
        outcome = fuzz.run_one(name, data)
        if outcome.crash is not None:
            raise outcome.crash
        assert not outcome.broke, f"{name}: {outcome.broke}"

    one()


def test_the_regressions_name_real_targets() -> None:
    assert {target for target, _ in fuzz.REGRESSIONS()} <= set(fuzz.TARGETS)


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
def test_a_crash_and_a_broken_bound_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver is not blind: a target that raises outside its class is a crash, one that
    takes too much memory breaks the bound."""
    def raises(data: bytes, tmp: Path) -> object:
        raise IndexError("a parser's own exception")

    def hungry(data: bytes, tmp: Path) -> object:
        return len(bytearray(fuzz.MEMORY_BOUND + (64 << 20)))

    monkeypatch.setitem(fuzz.TARGETS, "raises", raises)
    monkeypatch.setitem(fuzz.EXPECTED, "raises", fuzz.EXPECTED["elf"])
    monkeypatch.setitem(fuzz.TARGETS, "hungry", hungry)
    monkeypatch.setitem(fuzz.EXPECTED, "hungry", fuzz.EXPECTED["elf"])
    assert isinstance(fuzz.run_one("raises", b"x").crash, IndexError)
    assert "peak memory" in fuzz.run_one("hungry", b"x").broke
