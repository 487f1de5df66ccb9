"""Every output an op writes is kept and compared (issue #63 part 2): harness_run.outputs
keeps each tensor an op returns and each input it writes in place, compare_outputs.compare
compares them all (it compared only the first before).  The FAKE torch here has tensors
of Python lists; it proves nothing of a GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sm121_build.jobs.payload import compare_outputs, harness_run


class FakeTensor:
    """FAKE: a tensor of Python floats; `.cpu()` a copy marked as on the host."""

    def __init__(self, values: list[float], on_host: bool = False) -> None:
        self.values, self.on_host = values, on_host

    def cpu(self) -> FakeTensor:
        return FakeTensor(list(self.values), on_host=True)


FAKE_TORCH = SimpleNamespace(Tensor=FakeTensor)


def test_outputs_keeps_every_tensor_returned_and_written() -> None:
    out, lse, kcache = FakeTensor([1.0]), FakeTensor([2.0]), FakeTensor([3.0])
    kept = harness_run.outputs(FAKE_TORCH, [out, None, lse], written=(kcache,))
    assert [t.values for t in kept] == [[1.0], [2.0], [3.0]]
    assert all(t.on_host for t in kept)
    assert [t.values for t in harness_run.outputs(FAKE_TORCH, out)] == [[1.0]]


def test_first_call_returns_every_output(capsys: pytest.CaptureFixture[str]) -> None:
    torch = SimpleNamespace(Tensor=FakeTensor, cuda=SimpleNamespace(synchronize=lambda: None))
    kept = harness_run.first_call(torch, lambda: (FakeTensor([1.0]), FakeTensor([5.0])), [],
                                  ("varlen_fwd", "c"))
    assert [t.values for t in kept] == [[1.0], [5.0]]
    assert '"case": "c"' in capsys.readouterr().out


@pytest.fixture
def list_math(monkeypatch: pytest.MonkeyPatch) -> None:
    """compare's per-tensor measures over FakeTensors (the real ones need torch)."""
    monkeypatch.setattr(compare_outputs, "same_bits",
                        lambda torch, a, b: a.values == b.values)

    def difference(torch: Any, a: FakeTensor, b: FakeTensor) -> float | None:
        if len(a.values) != len(b.values) or any(v != v for v in a.values + b.values):
            return None
        return max((abs(x - y) for x, y in zip(a.values, b.values, strict=True)),
                   default=0.0)

    monkeypatch.setattr(compare_outputs, "difference", difference)
    monkeypatch.setattr(compare_outputs, "ulps", lambda torch, a, b: None
                        if (d := difference(torch, a, b)) is None else int(d * 10))


@pytest.mark.usefixtures("list_math")
def test_a_difference_in_a_later_output_is_not_equal() -> None:
    """The bug: only result[0] was saved, so an op whose second output (FA2's softmax_lse,
    an appended KV cache) differed was proven equal."""
    same = (FakeTensor([1.0, 2.0]), FakeTensor([0.5]))
    later = (FakeTensor([1.0, 2.0]), FakeTensor([0.75]))
    assert compare_outputs.compare(None, same, same) == {
        "bitwise_equal": True, "max_abs_diff": 0.0, "max_ulp": 0, "outputs": 2,
        "differing": []}
    said = compare_outputs.compare(None, same, later)
    assert said["bitwise_equal"] is False and said["differing"] == [1]
    assert said["max_abs_diff"] == 0.25 and said["max_ulp"] == 2


@pytest.mark.usefixtures("list_math")
def test_a_missing_output_and_a_nan_are_said() -> None:
    one = (FakeTensor([1.0]),)
    two = (FakeTensor([1.0]), FakeTensor([2.0]))
    said = compare_outputs.compare(None, two, one)
    assert said["bitwise_equal"] is False and said["differing"] == [1]
    assert said["max_abs_diff"] is None and said["outputs"] == 2
    nan = (FakeTensor([1.0]), FakeTensor([float("nan")]))
    said = compare_outputs.compare(None, two, nan)
    assert said["max_abs_diff"] is None and said["max_ulp"] is None
    # a file of an older harness: one tensor per case, compared as one output
    assert compare_outputs.compare(None, FakeTensor([1.0]), FakeTensor([1.0]))["outputs"] == 1
