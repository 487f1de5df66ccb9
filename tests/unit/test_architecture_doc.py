"""ARCHITECTURE.md stays true: every module, file, function or constant it names in
backticks is where it says (a `pkg/module.name` or `module.name` reference resolves; a
`path/file.py` exists), and its figures table is what `benchmarks/layers.py --markdown`
measures on this tree."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "ARCHITECTURE.md").read_text()
PACKAGE = ROOT / "sm121_build"
# `path/to/file.ext`, `pkg/module.attr.attr`, `module.attr` (a call's `()` dropped)
TOKEN = re.compile(r"`([A-Za-z_][\w/.-]*?)(?:\(\))?`")
FILE_KINDS = (".py", ".yaml", ".yml", ".toml", ".json", ".md", ".in", ".sh")


def _modules_named(stem: str) -> list[str]:
    found = [p for p in (*PACKAGE.rglob(f"{stem}.py"), *(ROOT / "devkit").glob(f"{stem}.py"))]
    return [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in found]


def _resolves(module: str, attrs: list[str]) -> bool:
    try:
        value: object = importlib.import_module(module)
    except ImportError:
        return False
    for attr in attrs:
        if not hasattr(value, attr):
            return False
        value = getattr(value, attr)
    # a function or class is where it is defined, not where it is imported
    defined = getattr(value, "__module__", module) if callable(value) else module
    return defined == module or not attrs


def _where(token: str) -> str | None:
    """Why `token` is not where the document says, or None when it is (or is no name)."""
    if token.endswith((".so", ".whl", ".tar")):
        return None  # a file of an image or a wheel, not of this repository
    if token.endswith(FILE_KINDS):
        if "/" not in token:
            return None  # a file a run writes (`manifest.json`), not a path here
        places = [ROOT / token, PACKAGE / token]
        return None if any(p.exists() for p in places) else "no such file"
    if "/" in token:
        path, _, attrs = token.partition(".")
        base = path if path.startswith(("tests/", "devkit/", "benchmarks/")) \
            else f"sm121_build/{path}"
        if not (ROOT / f"{base}.py").exists():
            return None if (ROOT / base).is_dir() else "no such module"
        return None if not attrs or _resolves(base.replace("/", "."), attrs.split(".")) \
            else f"{base}.py has no {attrs}"
    if "." in token and token.split(".")[0].isidentifier():
        stem, *attrs = token.split(".")
        candidates = _modules_named(stem)
        if not candidates:
            return None  # a word with a dot, not a module (`X.Y`)
        return None if any(_resolves(m, attrs) for m in candidates) \
            else f"no module {stem} with {'.'.join(attrs)}"
    return None


def test_every_name_the_document_gives_is_where_it_says() -> None:
    sys.path.insert(0, str(ROOT))
    wrong = sorted({f"{t}: {why}" for t in TOKEN.findall(DOC) if (why := _where(t))})
    assert not wrong, wrong


def test_the_figures_are_what_the_script_measures() -> None:
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layers.py"),
                            "--markdown"], capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.strip()
    assert table in DOC, f"paste `python benchmarks/layers.py --markdown` into " \
        f"ARCHITECTURE.md:\n{table}"


def test_no_function_takes_an_arch_list_as_str() -> None:
    """An arch list is an `ArchList` from the edge down (the figure above counts them)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import layers

    assert layers.signatures(layers.modules())[2] == 0
