"""A pull's progress from the engine's event stream: bytes, rate, time left.

`docker pull`'s API events name a layer (`id`) and its state; while downloading they carry
`progressDetail: {current, total}` in bytes.  The total of a layer is known once it starts
downloading, so the sum over layers seen is a floor until every layer has started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sm121_build.core.units import duration, human_size

DONE = ("Pull complete", "Already exists", "Download complete")


@dataclass
class PullProgress:
    ref: str
    started: float
    totals: dict[str, int] = field(default_factory=dict)  # layer -> bytes
    current: dict[str, int] = field(default_factory=dict)  # layer -> bytes downloaded
    states: dict[str, str] = field(default_factory=dict)

    def feed(self, event: dict[str, Any]) -> None:
        layer, state = event.get("id"), event.get("status")
        if not isinstance(layer, str) or not isinstance(state, str) \
                or state.startswith("Pulling from"):  # the tag's own line, not a layer
            return
        self.states[layer] = state
        detail = event.get("progressDetail") or {}
        if state == "Downloading" and isinstance(detail, dict):
            total, now = detail.get("total"), detail.get("current")
            if isinstance(total, int) and total > 0:
                self.totals[layer] = total
            if isinstance(now, int):
                self.current[layer] = now
        elif state in DONE and layer in self.totals:
            self.current[layer] = self.totals[layer]

    @property
    def downloaded(self) -> int:
        return sum(self.current.values())

    @property
    def known(self) -> int:
        return sum(self.totals.values())

    def layers_done(self) -> int:
        return sum(1 for state in self.states.values() if state in ("Pull complete",
                                                                   "Already exists"))

    def text(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-6)
        rate = self.downloaded / elapsed
        waiting = any(state in ("Waiting", "Pulling fs layer") for state in self.states.values())
        of = f"{'≥' if waiting else ''}{human_size(self.known)}"
        parts = [f"pulling {self.ref}: {human_size(self.downloaded)} of {of}, {human_size(rate)}/s"]
        left = self.known - self.downloaded
        if rate > 0 and left > 0:
            more = " (more to come)" if waiting else ""
            parts.append(f"about {duration(left / rate)} left{more}")
        parts.append(f"{self.layers_done()}/{len(self.states)} layers")
        return ", ".join(parts)

    def summary(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-6)
        return (f"pulled {self.ref}: {human_size(self.downloaded)} in {duration(elapsed)} "
                f"({human_size(self.downloaded / elapsed)}/s), {len(self.states)} layers "
                f"({sum(1 for s in self.states.values() if s == 'Already exists')} already here)")
