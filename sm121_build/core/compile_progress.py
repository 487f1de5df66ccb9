"""Ninja's `[n/N]` counter, read from a build's output, as a progress line with an ETA.

Ninja prints `[finished/total] DESCRIPTION` when it starts a step (BuildKit's plain
progress prefixes `#12 123.4 `).  From those lines alone: the share done, the time per
phase (each CMake project is a ninja run of its own: the counter starts again), the steps
running (started less finished), and which of them started first.

The ETA: with a recorded ninja log of a build of the same target (`.ninja_log`: start and
end of each step; the real builds of docs/real-build.md ship in data/ninja/), the time the
recorded build took from the same share of finished steps to its end, scaled by how fast this build
has gone so far against the recording (so a Spark's 20 cores and a 16-core x86 host both
calibrate themselves); without one, the mean time per finished step so far.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources

from sm121_build.core.units import duration

# (its description is group 3 with the line's trailing space stripped: a lazy `(\S.*?)\s*$`
# tried the rest of the line at each character, quadratic in a line of spaces)
STEP = re.compile(r"\[(\d+)/(\d+)\]\s+(\S.*)")
# BuildKit's own step headers (`#7 [2/3] COPY ...`, `#9 [builder 3/7] RUN ...`): not ninja's
BUILDKIT_STEP = re.compile(r"^#\d+ \[[^\]]*\d+/\d+\]")
MIN_DONE = 3  # steps finished before an ETA is given at all
CALIBRATED = 0.1  # share of a recording's time behind it before its pace is used


@dataclass(frozen=True)
class History:
    """A recorded ninja run: when each step ended (seconds from the first start)."""

    name: str
    ends: tuple[float, ...]  # sorted

    @classmethod
    def from_ninja_log(cls, name: str, text: str) -> History:
        rows = [line.split("\t") for line in text.splitlines()
                if line and not line.startswith("#")]
        spans = [(int(row[0]), int(row[1])) for row in rows if len(row) >= 4]
        if not spans:
            raise ValueError(f"{name}: no steps in the ninja log")
        first = min(start for start, _ in spans)
        return cls(name, tuple(sorted((end - first) / 1000 for _, end in spans)))

    @property
    def steps(self) -> int:
        return len(self.ends)

    @property
    def target(self) -> str:
        """The CMake target it built (the file name's first part: `_vllm_fa2_C-...`)."""
        return self.name.split("-", 1)[0]

    def time_at(self, done: int) -> float:
        """Seconds until `done` steps had finished."""
        return 0.0 if done <= 0 else self.ends[min(done, self.steps) - 1]


def shipped_histories() -> tuple[History, ...]:
    folder = resources.files("sm121_build") / "data" / "ninja"
    return tuple(History.from_ninja_log(item.name.removesuffix(".ninja_log"),
                                        item.read_text())
                 for item in sorted(folder.iterdir(), key=lambda i: i.name)
                 if item.name.endswith(".ninja_log"))


def _pick(histories: tuple[History, ...], phase: Phase) -> History | None:
    """The recording of the target this phase builds (ninja names `<target>.dir/` objects)."""
    seen = " ".join(what for _, what in phase.starts[:20])
    return next((h for h in histories if f"/{h.target}.dir/" in seen), None)


@dataclass
class Phase:
    total: int
    started_at: float
    done: int = 0
    starts: list[tuple[float, str]] = field(default_factory=list)  # in start order


@dataclass
class CompileProgress:
    """Feed it every output line with the time; ask for `text()` when showing."""

    histories: tuple[History, ...] = ()
    phases: list[Phase] = field(default_factory=list)

    def feed(self, line: str, now: float) -> bool:
        """True when the line was a ninja step."""
        found = STEP.search(line)
        if not found or BUILDKIT_STEP.match(line):
            return False
        done, total, what = int(found.group(1)), int(found.group(2)), found.group(3).rstrip()
        if total == 0 or done > total:
            return False
        phase = self.phases[-1] if self.phases else None
        if phase is None or total != phase.total or done < phase.done:
            phase = Phase(total, now)
            self.phases.append(phase)
        phase.done = done
        phase.starts.append((now, what))
        return True

    @property
    def current(self) -> Phase | None:
        return self.phases[-1] if self.phases else None

    def eta(self, now: float) -> tuple[float, str] | None:
        """(seconds left in this phase, how it was estimated), once enough steps are done."""
        phase = self.current
        if phase is None or phase.done < MIN_DONE:
            return None
        elapsed = max(now - phase.started_at, 1e-6)
        recorded = _pick(self.histories, phase)
        # the recording at the same share done (its step count may differ a little)
        at = round(phase.done * recorded.steps / phase.total) if recorded else 0
        if recorded is not None:
            then, total = recorded.time_at(at), recorded.ends[-1]
            # the pace against the recording once a tenth of its time is behind it (before,
            # a few quick steps would say nothing of the machine): its own pace until then
            if then >= CALIBRATED * total:
                return max((total - then) * elapsed / then, 0.0), \
                    f"from the timings of {recorded.name}"
            return max(total - elapsed, 0.0), \
                f"from the timings of {recorded.name}, not yet calibrated"
        return elapsed / phase.done * (phase.total - phase.done), "from the steps so far"

    def running(self) -> tuple[int, tuple[float, str] | None]:
        """How many steps run now, and the first-started of them (ninja finishes steps in
        no set order: this counts the newest starts as the running ones)."""
        phase = self.current
        if phase is None:
            return 0, None
        count = max(len(phase.starts) - phase.done, 0)
        return count, (phase.starts[-count] if count else None)

    def share(self) -> float:
        phase = self.current
        return phase.done / phase.total if phase else 0.0

    def text(self, now: float) -> str:
        phase = self.current
        if phase is None:
            return ""
        number = f" (part {len(self.phases)})" if len(self.phases) > 1 else ""
        parts = [f"compiling{number} [{phase.done}/{phase.total}] {self.share():.0%}, "
                 f"{duration(now - phase.started_at)}"]
        eta = self.eta(now)
        if eta is not None:
            parts.append(f"about {duration(eta[0])} left ({eta[1]})")
        count, oldest = self.running()
        if oldest is not None:
            since, what = oldest
            parts.append(f"{count} running, longest {_short(what)} ({duration(now - since)})")
        return "; ".join(parts)


def _short(description: str) -> str:
    """`Building CUDA object CMakeFiles/_C.dir/csrc/x/scaled_mm_c2x.cu.o` -> scaled_mm_c2x.cu"""
    last = description.split()[-1] if description.split() else description
    name = last.rsplit("/", 1)[-1]
    return name.removesuffix(".o") if name.endswith((".cu.o", ".cpp.o", ".c.o")) else name
