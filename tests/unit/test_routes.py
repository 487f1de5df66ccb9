"""Generated from `devkit/routes.ROUTES`: every route against every policy.

Each cell that names a function is checked against the code: a static call graph of the
package (calls resolved through each module's own imports: `f()` to the `f` it defines or
imports, `x.f()` to the methods named `f` of the classes it defines or imports, a module's
`m.f()` to that module's `f`) must reach that function from the route's entry points.
Each cell that does not apply says why.  ARCHITECTURE.md carries the table as rendered."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from devkit.routes import ROUTES, NotApplicable, Reached, Safeguard, table

PACKAGE = Path(__file__).resolve().parents[2] / "sm121_build"
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"


@dataclass
class Module:
    name: str
    defs: dict[str, ast.AST] = field(default_factory=dict)  # qualified name -> def
    names: dict[str, str] = field(default_factory=dict)  # imported name -> "module:name"
    modules: dict[str, str] = field(default_factory=dict)  # alias -> module
    imported: set[str] = field(default_factory=set)  # package modules it imports from


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


@cache
def _graph(root: Path = PACKAGE) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        module = modules[name] = Module(name)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sm121_build"):
                source = node.module.removeprefix("sm121_build").lstrip(".")  # type: ignore[union-attr]
                for alias in node.names:
                    if f"{source}.{alias.name}".lstrip(".") in _all_modules(root):
                        module.modules[alias.asname or alias.name] = \
                            f"{source}.{alias.name}".lstrip(".")
                    else:
                        module.names[alias.asname or alias.name] = f"{source}:{alias.name}"
                    module.imported.add(source)
        _collect(module, tree.body, "")
    return modules


@cache
def _all_modules(root: Path) -> frozenset[str]:
    return frozenset(_module_name(p, root) for p in root.rglob("*.py"))


def _collect(module: Module, body: list[ast.stmt], prefix: str) -> None:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            module.defs[prefix + node.name] = node
            _collect(module, node.body, prefix + node.name + ".")


def _callees(modules: dict[str, Module], key: str) -> set[str]:
    """What one function calls, resolved through its module's imports."""
    name, qual = key.split(":")
    module = modules[name]
    node = module.defs[qual]
    found: set[str] = set()
    scope = [name, *module.imported]
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        if isinstance(func, ast.Name):
            target = func.id
            if target in module.defs:
                found.add(f"{name}:{target}")
                found |= {f"{name}:{q}" for q in module.defs if q == f"{target}.__init__"}
            elif target in module.names:
                source, _, imported = module.names[target].partition(":")
                if source in modules:
                    found |= {f"{source}:{q}" for q in modules[source].defs
                              if q in (imported, f"{imported}.__init__", f"{imported}.__call__")}
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else ""
            if owner in module.modules:
                source = module.modules[owner]
                if func.attr in modules[source].defs:
                    found.add(f"{source}:{func.attr}")
                continue
            for other in scope:
                for qual in modules.get(other, Module(other)).defs:
                    method = qual.rsplit(".", 1)[-1] == func.attr and "." in qual
                    if method or (qual == func.attr and owner in modules[name].names):
                        found.add(f"{other}:{qual}")
    for ref in (n for n in ast.walk(node) if isinstance(n, ast.Name)):  # f passed on:
        if isinstance(ref.ctx, ast.Load) and ref.id in module.defs:  # pool.submit(f, ...)
            found.add(f"{name}:{ref.id}")
    return found


def reached(entries: tuple[str, ...], root: Path = PACKAGE) -> set[str]:
    modules = _graph(root)
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        todo += [c for c in _callees(modules, key) if c not in seen]
    return seen


CELLS = [(route, policy) for route in ROUTES for policy in Safeguard]


def test_every_route_has_a_cell_for_every_policy() -> None:
    for route in ROUTES:
        assert set(route.cells) == set(Safeguard), route.name
    assert len({route.name for route in ROUTES}) == len(ROUTES)


@pytest.mark.parametrize(("route", "policy"), CELLS,
                         ids=[f"{r.name}-{p.name}" for r, p in CELLS])
def test_each_cell_holds_in_the_code(route: object, policy: Safeguard) -> None:
    cell = route.cells[policy]  # type: ignore[attr-defined]
    modules = _graph()
    for entry in route.entries:  # type: ignore[attr-defined]
        name, qual = entry.split(":")
        assert qual in modules[name].defs, f"no entry point {entry}"
    if isinstance(cell, NotApplicable):
        assert len(cell.why) > 10
        return
    assert isinstance(cell, Reached)
    name, qual = cell.function.split(":")
    assert qual in modules[name].defs, f"{cell.function} is not defined"
    assert cell.function in reached(route.entries), (  # type: ignore[attr-defined]
        f"{route.name}: {policy.value} is applied by {cell.function}, "  # type: ignore[attr-defined]
        "which the route's code does not reach")


def test_architecture_shows_the_table() -> None:
    assert table() in ARCHITECTURE.read_text(), "paste routes.table() into ARCHITECTURE.md"


def test_the_call_graph_misses_a_policy_a_route_skips(tmp_path: Path) -> None:
    """The check is not blind: a route that does not call the policy is caught, one that
    calls it through an import, a method or a module alias is not."""
    package = tmp_path / "sm121_build"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "policy.py").write_text("def require_tags_free():\n    pass\n"
                                       "class Pipe:\n    def tag(self):\n"
                                       "        require_tags_free()\n")
    (package / "route.py").write_text(
        "from sm121_build.policy import Pipe, require_tags_free\n"
        "from sm121_build import policy\n"
        "def direct():\n    require_tags_free()\n"
        "def method(p):\n    p.tag()\n"
        "def aliased():\n    policy.require_tags_free()\n"
        "def skips():\n    print('tagged')\n")
    for entry in ("route:direct", "route:method", "route:aliased"):
        assert "policy:require_tags_free" in reached((entry,), package), entry
    assert "policy:require_tags_free" not in reached(("route:skips",), package)
