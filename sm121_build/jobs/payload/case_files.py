"""What the payload's case derivations (fa2_kernels.py, marlin_kernels.py) share: a
derivation's cases read back as outside input, and the command line that prints one.

Standard library only; imported as a sibling where a harness runs as a script.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any


def case_items(data: Any) -> list[Any]:
    """The cases of a derivation's JSON (`{"cases": [...]}`); ValueError if it is none."""
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise ValueError("not a derivation: no list of cases")
    return list(data["cases"])


# what a derivation writes beside each case's fields: its key and the kernels it launches
DERIVED = frozenset({"key", "expects"})


def typed_case(item: Any, defaults: Any, pairs: Sequence[str] = ()) -> Any:
    """One case of a derivation's JSON as `defaults`' dataclass: its fields (and `DERIVED`'s,
    nothing else), each of the default's type (an integer where a float is wanted taken as
    one), those of `pairs` two integers; ValueError saying which field is not."""
    if not isinstance(item, dict):
        raise ValueError("a case is not an object")
    known = {f.name for f in fields(defaults)}
    unknown = sorted(str(k)[:40] for k in item if k not in known and k not in DERIVED)
    if unknown:  # (another family's case, or a field no release wrote)
        raise ValueError(f"a case has fields this harness does not know: {unknown[:3]}")
    values = {k: v for k, v in item.items() if k in known}
    for name in pairs:
        if name in values:
            pair = values[name]
            if not (isinstance(pair, list) and len(pair) == 2
                    and all(type(x) is int for x in pair)):
                raise ValueError(f"case {name} {pair!r} is not two integers")
            values[name] = (pair[0], pair[1])
    for name, value in values.items():
        want = type(getattr(defaults, name))
        ok = isinstance(value, want) and (want is not int or type(value) is int)
        if want is float and type(value) is int:
            values[name], ok = float(value), True
        if not ok:
            raise ValueError(f"case field {name}: {value!r} is not a {want.__name__}")
    return replace(defaults, **values)


def checked_cases(data: Any, defaults_for: Callable[[Any], Any], pairs: Sequence[str],
                  invalid: Callable[[Any], str | None]) -> list[Any]:
    """A derivation's cases (`Derived.to_json`), each typed as `defaults_for(item)` is and
    refused where `invalid` says why; ValueError in one line."""
    out = []
    for item in case_items(data):
        case = typed_case(item, defaults_for(item), pairs)
        why = invalid(case)
        if why:
            raise ValueError(f"case {case.key}: {why}")
        out.append(case)
    return out


MAX_FILE_BYTES = 64 << 20  # a derivation's cases or names: a few MB at most


def bounded_text(path: str) -> str:
    """A harness's input file as UTF-8 text: a regular file (a FIFO or device is refused,
    never waited on: opened without blocking), refused (ValueError) past `MAX_FILE_BYTES`
    before more of it is read; OSError where it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: over {MAX_FILE_BYTES >> 20} MiB")
    return data.decode("utf-8")


def read_cases(opts: Any, cases_from_json: Callable[[Any], list[Any]],
               parse: Callable[[str], Any] | None = None) -> tuple[list[str] | None, list[Any]]:
    """The files a harness's options name, read before any GPU work: the kernel names of
    `--kernels` (None without it; each read by `parse`, which raises on one it cannot
    read) and the cases of `--cases`; OSError or ValueError."""
    if opts.cases is not None:
        try:
            data = json.loads(bounded_text(opts.cases))
        except RecursionError:  # arrays nested thousands deep: no derivation's
            raise ValueError(f"{opts.cases}: JSON nested too deep") from None
        return None, list(cases_from_json(data))
    if opts.kernels is not None:
        names = [line.strip() for line in bounded_text(opts.kernels).splitlines()
                 if line.strip()]
        if parse is not None:
            for name in names:
                parse(name)
        return names, []
    return None, []


def derivation_main(argv: list[str], usage: str, sizes: tuple[Any, str],
                    derive: Callable[[list[str], Any], Any]) -> int:
    """`SCRIPT NAMES.txt [CC N M]`: the derivation of the names (one a line) for a GPU
    (`sizes`: the default GPU's, and what N and M are; `CC N M` make another of the same
    type) as JSON; a bad argument or file in one `usage:` line, exit 2."""
    default, what = sizes
    try:
        if len(argv) not in (1, 4):
            raise ValueError("one or four arguments")
        names = [line.strip() for line in bounded_text(argv[0]).splitlines() if line.strip()]
        gpu = default
        if len(argv) == 4:
            major, _, minor = argv[1].partition(".")
            numbers = [major, minor or "0", argv[2], argv[3]]
            if not all(n.isascii() and n.isdigit() and len(n) <= 12 for n in numbers):
                raise ValueError(f"{argv[1][:20]!r} {argv[2][:20]!r} {argv[3][:20]!r} are not "
                                 f"a compute capability and {what}")
            gpu = type(default)(*(int(n) for n in numbers))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        text = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        sys.stderr.write(f"{usage}: {text}\n")
        return 2
    sys.stdout.write(json.dumps(derive(names, gpu).to_json(), indent=1) + "\n")
    return 0
