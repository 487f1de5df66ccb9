"""How long the tool waits on something outside it: the Docker engine and a registry.

Each limit is the time without an answer, not the length of the work: a 20 GB pull that keeps
sending progress runs as long as it needs, a registry that accepts the connection and then
says nothing ends the wait after `registry` seconds.  Both are set by environment variables
(seconds; docs/reference/environment.md), read and checked before any work:

| variable                | default | what waits                                              |
|-------------------------|---------|---------------------------------------------------------|
| SM121_ENGINE_TIMEOUT    | 120     | any call to the engine (ping, inspect, read a file, tag) |
| SM121_REGISTRY_TIMEOUT  | 60      | a registry lookup, and a pull or push with no progress   |
| SM121_CMAKE_TIMEOUT     | 60      | one evaluation of a source tree's CMake (then killed)    |
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sm121_build.core.errors import Sm121Error

ENGINE_VARIABLE = "SM121_ENGINE_TIMEOUT"
REGISTRY_VARIABLE = "SM121_REGISTRY_TIMEOUT"
CMAKE_VARIABLE = "SM121_CMAKE_TIMEOUT"
DEFAULT_ENGINE_S = 120.0
DEFAULT_REGISTRY_S = 60.0
DEFAULT_CMAKE_S = 60.0
MAX_S = 86_400.0


@dataclass(frozen=True)
class Limits:
    """Seconds without an answer before a call is given up."""

    engine_s: float
    registry_s: float
    cmake_s: float = DEFAULT_CMAKE_S

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Limits:
        """The limits the environment (this process's, or `environ`) sets, defaults
        otherwise; a value that is not a number of seconds in (0, 86400] is refused with
        one line."""
        env = os.environ if environ is None else environ
        return cls(_seconds(env, ENGINE_VARIABLE, DEFAULT_ENGINE_S),
                   _seconds(env, REGISTRY_VARIABLE, DEFAULT_REGISTRY_S),
                   _seconds(env, CMAKE_VARIABLE, DEFAULT_CMAKE_S))


SECONDS_RULE = f"expected a number of seconds above 0 and at most {MAX_S:.0f}"
_DECIMAL = re.compile(r"[0-9]{1,16}(?:\.[0-9]{1,16})?", re.ASCII)


def seconds(raw: str) -> float:
    """A duration the user gives (a limit here, `aot --timeout`): finite, above 0 and at
    most `MAX_S`, else a ValueError saying `SECONDS_RULE`; the one rule for every one."""
    # Decimal ASCII digits with an optional fraction: float() alone takes fullwidth and
    # Arabic-Indic digits, `1_0`, `0x`-free exponents and `inf`.
    text = raw.strip(" \t")  # str.strip() also takes \x1c-\x1f and \x85
    value = float(text) if _DECIMAL.fullmatch(text) else math.nan
    if not (0 < value <= MAX_S):  # NaN compares false: refused with inf and 1e300
        raise ValueError(SECONDS_RULE)
    return value


def _seconds(environ: Mapping[str, str], variable: str, default: float) -> float:
    raw = environ.get(variable, "").strip(" \t")
    if not raw:
        return default
    try:
        return seconds(raw)
    except ValueError:
        raise Sm121Error(f"{variable}={raw!r}: {SECONDS_RULE}") from None
