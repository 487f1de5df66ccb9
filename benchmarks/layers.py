"""The shape of the package, on any commit: the import graph between its folders (module-level
and in-function imports), the cycles in it, how many of its modules `sm121-build audit FILE`
loads (and whether Docker, the engine, git or the Dockerfile renderer are among them), the
length of the main job's procedure, the functions (outside click commands) that take more
than five parameters, and the parameters that carry an arch list as a `str`.

Run from a checkout (any commit: `git stash; git checkout REV; python benchmarks/layers.py`):

    python benchmarks/layers.py [--file SO]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import modules_loaded  # noqa: E402

PACKAGE = ROOT / "sm121_build"
HEAVY = {"docker": "the Docker SDK", "engine": "the engine module", "render": "the renderer",
         "pin": "the git fetcher"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(known: dict[str, Path]) -> list[tuple[str, str, bool]]:
    """(importer, imported module, in a function) for every import of the package itself."""
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.append(full if full in known else node.module)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.startswith("sm121_build") and target in known:
                    found.append((name, target, node.col_offset > 0))
    return found


def folder(module: str) -> str:
    """The package folder a module lives in (`(top) name` for the package's own modules)."""
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "(top) " + (parts[1] if len(parts) > 1 else "")


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def main_job_lines(known: dict[str, Path]) -> tuple[str, int]:
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "run_build":
                return name, (node.end_lineno or node.lineno) - node.lineno + 1
    return "?", 0


ARCH_PARAMETER = ("arch", "archs", "arch_list", "arch_cmake")
MAX_PARAMETERS = 5


def _is_click_command(node: ast.FunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        text = ast.unparse(target)
        if text.startswith("click.") or text.endswith((".command", ".group")):
            return True
    return False


def signatures(known: dict[str, Path]) -> tuple[list[tuple[str, int]], int, int]:
    """(functions of more than MAX_PARAMETERS parameters, not click commands, with their
    count), how many functions there are, and how many parameters named as an arch list
    are annotated `str`."""
    wide: list[tuple[str, int]] = []
    total = arch_str = 0
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            total += 1
            args = [a for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)
                    if a.arg not in ("self", "cls")]
            arch_str += sum(1 for a in args if a.arg in ARCH_PARAMETER and a.annotation is not None
                            and "str" in ast.unparse(a.annotation))
            if len(args) > MAX_PARAMETERS and not _is_click_command(node):
                wide.append((f"{name}.{node.name}", len(args)))
    return sorted(wide, key=lambda item: -item[1]), total, arch_str


def figures(known: dict[str, Path], file: str) -> str:
    """The figures ARCHITECTURE.md quotes, as its Markdown table."""
    found = imports(known)
    module_cycles = cycles({(a, b) for a, b, _ in found})
    loaded = [n for n in modules_loaded("audit", file) if n.startswith("sm121_build")]
    where, length = main_job_lines(known)
    wide, _total, arch_str = signatures(known)
    rows = [("modules in the package; import cycles between them", f"{len(known)}; "
             f"{len(module_cycles)}"),
            ("modules `sm121-build audit FILE` loads", str(len(loaded))),
            ("functions with more than 5 parameters (click commands aside)", str(len(wide))),
            ("parameters carrying an arch list as `str`", str(arch_str)),
            ("the main job", f"`{where.removeprefix('sm121_build.').replace('.', '/', 2)}"
             f".run_build`, {length} lines")]
    return "\n".join(["| figure | now |", "|---|---|",
                      *(f"| {name} | {value} |" for name, value in rows)])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--file", default=sys.executable, help="what `audit` reads (any ELF)")
    parser.add_argument("--markdown", action="store_true",
                        help="only the figures table ARCHITECTURE.md carries (a test compares)")
    options = parser.parse_args()
    known = modules()
    if options.markdown:
        print(figures(known, options.file))
        return 0
    found = imports(known)
    between = Counter((folder(a), folder(b), lazy) for a, b, lazy in found
                      if folder(a) != folder(b))
    print(f"{len(known)} modules; imports between folders (importer -> imported: count):")
    for (a, b, lazy), count in sorted(between.items()):
        print(f"  {a:>22} -> {b:<22} {count:3d}{'  (in functions)' if lazy else ''}")
    module_cycles = cycles({(a, b) for a, b, _ in found})
    folder_cycles = cycles({(folder(a), folder(b)) for a, b, _ in found
                            if folder(a) != folder(b) and not folder(a).startswith("(top)")
                            and not folder(b).startswith("(top)")})
    print(f"module cycles: {len(module_cycles)}" + "".join(
        f"\n  {' <-> '.join(c)}" for c in module_cycles))
    print(f"folder cycles: {len(folder_cycles)}" + "".join(
        f"\n  {' <-> '.join(c)}" for c in folder_cycles))
    loaded = modules_loaded("audit", options.file)
    own = [n for n in loaded if n.startswith("sm121_build")]
    heavy = [what for key, what in HEAVY.items()
             if any(n == key or n.endswith(f".{key}") for n in loaded)]
    print(f"`sm121-build audit FILE` loads {len(own)} of {len(known)} modules; "
          f"{', '.join(heavy) or 'no Docker SDK, engine, renderer or git fetcher'}"
          f"{' among them' if heavy else ''}")
    where, length = main_job_lines(known)
    print(f"main job: {where}.run_build, {length} lines")
    wide, total, arch_str = signatures(known)
    print(f"functions with more than {MAX_PARAMETERS} parameters (click commands aside): "
          f"{len(wide)} of {total}"
          + ("; the widest: " + ", ".join(f"{n.rsplit('.', 1)[1]} {c}" for n, c in wide[:5])
             if wide else ""))
    print(f"parameters carrying an arch list as str: {arch_str}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
