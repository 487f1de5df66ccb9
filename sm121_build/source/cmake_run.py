"""Where the source tree's CMake runs when a guard is evaluated: never on this host unless
asked for.

Evaluating a guard runs the tree's own `cmake/utils.cmake` (and the CMake text around each
call) through `cmake -P`: that is code from the tree, which can `execute_process()` anything
or loop forever.  So `guards` hands every evaluation to the runner of the current context:

- `jobs.framework.cmake_sandbox.ContainerCMake`, what every command uses: a throwaway container with
  no network, a read-only root, not root, one CPU and a time limit;
- `HostCMake`, only where the user asked for the tree's code to run here: `sm121-build local`
  (which runs the tree's whole CMake here anyway) or `SM121_CMAKE_ON_HOST=1`.

With no runner chosen, an evaluation is refused: code from a tree never runs by default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sm121_build.core.children import Program, run
from sm121_build.core.errors import Sm121Error
from sm121_build.core.interrupts import temp_dir

ON_HOST_VARIABLE = "SM121_CMAKE_ON_HOST"
# what the script finds where the tree's utils.cmake is included from
UTILS_AT = "src/cmake/utils.cmake"


@dataclass(frozen=True)
class CMakeScript:
    """One evaluation: the tree's cmake/utils.cmake, and the script run after including it."""

    utils: str
    body: str

    def text(self, root: str) -> str:
        """The whole script, the utils read from `root`/UTILS_AT."""
        return f'include("{root}/{UTILS_AT}")\n{self.body}'


@dataclass(frozen=True)
class CMakeOutput:
    """How `cmake -P` ended: its exit status (None: stopped at the time limit) and output."""

    status: int | None
    stdout: str
    stderr: str


class CMakeRunner(Protocol):
    """Runs one CMake script (`cmake -P`) somewhere, with a time limit."""

    def run(self, script: CMakeScript) -> CMakeOutput: ...


@dataclass(frozen=True)
class HostCMake:
    """`cmake -P` on this host: the tree's code runs with this user's rights.  Only for a
    run that asked for it (`sm121-build local`, SM121_CMAKE_ON_HOST=1)."""

    cmake: Callable[[], str]  # finds the binary
    seconds: float

    def run(self, script: CMakeScript) -> CMakeOutput:
        with temp_dir("sm121-explain-") as tmp:
            utils = Path(tmp) / UTILS_AT
            utils.parent.mkdir(parents=True)
            utils.write_text(script.utils, errors="surrogateescape")
            path = Path(tmp) / "explain.cmake"
            path.write_text(script.text(Path(tmp).as_posix()), errors="surrogateescape")
            result = run(Program((self.cmake(), "-P", str(path)), self.seconds, "cmake -P",
                                 cwd=Path(tmp)))
        if result.timed_out:
            return CMakeOutput(None, "", "")
        return CMakeOutput(result.returncode, result.text,
                           result.stderr.decode("utf-8", "replace"))


_RUNNER: ContextVar[CMakeRunner | None] = ContextVar("sm121_cmake_runner", default=None)


@contextmanager
def evaluating_with(runner: CMakeRunner) -> Iterator[None]:
    """Guard evaluations inside the block run through `runner`."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def on_host_asked() -> bool:
    """Whether the user asked for the tree's CMake to run on this host."""
    return os.environ.get(ON_HOST_VARIABLE, "").strip() == "1"


def current_runner() -> CMakeRunner:
    """The runner of this context; none chosen is refused (a tree's code never runs by
    default)."""
    runner = _RUNNER.get()
    if runner is None:
        raise Sm121Error("evaluating the source tree's CMake needs a throwaway container, and "
                         "none was set up for this command (set SM121_CMAKE_ON_HOST=1 to run "
                         "it on this host)")
    return runner
