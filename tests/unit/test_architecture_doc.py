"""ARCHITECTURE.md stays true: every module, file, function or constant it names in
backticks is where it says (a `pkg/module.name` or `module.name` reference resolves; a
`path/file.py` exists), every bare code name it gives (`Name`, `a_name`, `name(...)`, in the
text or in a code block) is defined in the code, a name it says is "in `path.py`" is defined
there, and its figures table is what `benchmarks/layers.py --markdown` measures on this
tree."""

from __future__ import annotations

import ast
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


# words in backticks that are not code names of this repository: a GPU, a variable of the
# environment or of CMake, an extension's name (a file of vLLM's)
NOT_CODE = re.compile(r"sm_\d+[af]?|[A-Z][A-Z0-9_]*|_\w*_C(_\w+)?|sm121_build")
CLASS_LIKE = re.compile(r"[A-Z][a-z]\w*")


def _defined() -> set[str]:
    """Every name the code defines: functions, classes, module and class constants and
    fields, attributes set on `self`, modules (by their file's stem)."""
    names: set[str] = set()
    for path in (*PACKAGE.rglob("*.py"), *(ROOT / "devkit").rglob("*.py"),
                 *(ROOT / "benchmarks").rglob("*.py")):
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id if isinstance(t, ast.Name) else t.attr for t in node.targets
                             if isinstance(t, (ast.Name, ast.Attribute)))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def bare_names(doc: str) -> set[str]:
    """The code names a document gives without a module: in the text, a backticked
    `Name`, `a_name` or `name(...)`; in a code block, every `name(` and CamelCase word."""
    text = re.sub(r"```.*?```", "", doc, flags=re.S)
    found = set()
    for token in re.findall(r"`([^`\n]+)`", text):
        match = re.fullmatch(r"([A-Za-z_]\w*)(\(.*\))?", token.strip())
        if match and (match.group(2) or "_" in match.group(1).strip("_")
                      or CLASS_LIKE.fullmatch(match.group(1))):
            found.add(match.group(1))
    for block in re.findall(r"```[^\n]*\n(.*?)```", doc, flags=re.S):
        found.update(re.findall(r"\b([A-Za-z_]\w*)\(", block))
        found.update(re.findall(r"\b([A-Z][a-z]+[A-Z]\w*)\b", block))
    return {name for name in found if not NOT_CODE.fullmatch(name)}


def stale_bare_names(doc: str, defined: set[str]) -> list[str]:
    return sorted(name for name in bare_names(doc) if name not in defined)


def misplaced(doc: str) -> list[str]:
    """Each "`A`, `B` in `path.py`" whose names `path.py` does not define itself."""
    wrong = []
    for match in re.finditer(r"((?:`[A-Za-z_]\w*(?:\(\))?`(?:,\s*|\s+and\s+|\s+or\s+)?)+)"
                             r"\s+in\s+`([\w/]+\.py)`", doc):
        path = ROOT / match.group(2)
        path = path if path.exists() else PACKAGE / match.group(2)
        if not path.exists():
            wrong.append(f"{match.group(2)}: no such file")
            continue
        tree = ast.parse(path.read_text())
        here = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        here |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                 if isinstance(t, ast.Name)}
        here |= {n.target.id for n in tree.body
                 if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        wrong += [f"{name} is not defined in {match.group(2)}"
                  for name in re.findall(r"`([A-Za-z_]\w*)", match.group(1)) if name not in here]
    return wrong


def test_every_bare_name_and_code_block_name_is_defined() -> None:
    assert stale_bare_names(DOC, _defined()) == []


def test_a_name_said_to_be_in_a_module_is_defined_there() -> None:
    assert misplaced(DOC) == []


def test_the_checks_find_a_planted_stale_name() -> None:
    """The issue's two examples, planted: a call in a code block that no longer exists, and
    a class said to be in a module it moved out of."""
    planted = ("The run:\n```\n  target  = target_for(...)   the delivery\n```\n"
               "and a bare `RunDecisionOf` and `gone_helper(...)`; options (`Options`, "
               "`Kernels` in `jobs/main_run/run.py`).\n")
    assert stale_bare_names(planted, _defined()) == ["RunDecisionOf", "gone_helper",
                                                     "target_for"]
    assert misplaced(planted) == ["Options is not defined in jobs/main_run/run.py"]


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
