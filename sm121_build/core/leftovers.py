"""What this process made in the engine and has not removed yet ("tag X", "container Y"):
when the engine goes away mid-run, the error line names what may be left there.  Kept here,
at the bottom, so the command line reads it without importing the engine (or Docker's SDK)."""

from __future__ import annotations

LEFT_BEHIND: set[str] = set()


def left_behind_line() -> str:
    """`; this run may have left …` for an error line, or "" when nothing is outstanding."""
    left = sorted(LEFT_BEHIND)
    return (f"; this run may have left {', '.join(left)} there: remove them once the engine "
            "is back (`docker rmi TAG`, `docker rm -f CONTAINER`)" if left else "")
