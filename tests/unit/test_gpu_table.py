"""GPUs are data (`sm121_build/data/gpus.yaml`), read once into `cuda/compat.GPU_TABLE`: the
default GPU, its driver, platform and source rules come from the table, and no module
outside `cuda/` decides by comparing a GPU with sm_121 (`== DEFAULT_TARGET`,
`== DEFAULT_POLICY`, a literal `"sm_121"`): it asks the GPU value (`is_default`,
`has_source_rules`, `facts`).  Nor does any module outside `cuda/` write the default GPU,
its arch or its driver's CUDA as a literal (`sm_121`, `12.1`, `13.0`): it names the table's
default (`DEFAULT_TARGET`, `DEFAULT_CUDA`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

import sm121_build
from sm121_build.cuda.binary import DEFAULT_DRIVER, DEFAULT_POLICY, gpu_policy
from sm121_build.cuda.compat import DEFAULT_TARGET, GPU_TABLE, KNOWN_ARCHS, is_default_gpu

PACKAGE = Path(sm121_build.__file__).parent
GPU_NAMES = {"DEFAULT_TARGET", "DEFAULT_POLICY"}


def test_the_table_is_the_one_source_of_gpu_facts() -> None:
    raw = yaml.safe_load((PACKAGE / "data" / "gpus.yaml").read_text())
    assert set(raw) == set(GPU_TABLE) == KNOWN_ARCHS
    (default,) = [arch for arch, row in raw.items() if row.get("default")]
    assert str(DEFAULT_TARGET) == f"sm_{default.replace('.', '')}"
    assert DEFAULT_POLICY.target == DEFAULT_TARGET and DEFAULT_TARGET.dotted == default
    assert tuple(int(p) for p in raw[default]["driver"].split(".")) == DEFAULT_DRIVER
    assert DEFAULT_POLICY.is_default and DEFAULT_POLICY.has_source_rules
    assert is_default_gpu("sm_121")
    hopper = gpu_policy("sm_90")
    assert not hopper.is_default and not hopper.has_source_rules
    assert hopper.target.facts.first_cuda == raw["9.0"]["first_cuda"]
    assert DEFAULT_TARGET.facts.platform == "linux/arm64" and DEFAULT_TARGET.facts.machine


def _compares_a_gpu(node: ast.Compare) -> bool:
    sides = [node.left, *node.comparators]
    named = any(isinstance(s, ast.Name) and s.id in GPU_NAMES for s in sides)
    literal = any(isinstance(s, ast.Constant) and s.value in ("sm_121", "12.1", 121)
                  for s in sides)
    calls = any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name)
                and s.func.id == "str" and s.args and isinstance(s.args[0], ast.Name)
                and s.args[0].id in GPU_NAMES for s in sides)
    return named or literal or calls


def test_no_module_outside_cuda_compares_a_gpu_with_the_spark() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("cuda/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _compares_a_gpu(node):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"ask the GPU value (is_default, has_source_rules): {found}"


# the default GPU's values as they are written: its target, its arch, its driver's CUDA
DEFAULT_LITERAL = re.compile(r"\bsm_121\b|(?<![\w.])12\.1(?![\d])|(?<![\w.])13\.0(?![\d])")
# (module, the literal's text) -> why it is not the default GPU written in code
NOT_THE_DEFAULT = {
    ("jobs/framework/run_warnings.py", "vllm/vllm-openai:nightly (CUDA 13.0), :cu129-nightly, "
     ":cu134-nightly"): "vLLM's tags and the CUDA each is built with: data about vLLM",
}


def _literals(tree: ast.AST) -> list[ast.Constant]:
    """Every string constant of a module but its docstrings (a docstring may say sm_121)."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docs]


def test_no_module_outside_cuda_writes_the_default_gpu_as_a_literal() -> None:
    """Issue 61: `sm_121`, `12.1` or `13.0` in code outside `cuda/` (a default, a message,
    an example in a help text) is the table's default written twice."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("cuda/"):
            continue
        for node in _literals(ast.parse(path.read_text())):
            text = str(node.value)
            if DEFAULT_LITERAL.search(text) and (rel, text) not in NOT_THE_DEFAULT:
                found.append(f"{rel}:{node.lineno}: {text[:60]!r}")
    assert not found, f"name the table's default (DEFAULT_TARGET, DEFAULT_CUDA): {found}"


def test_the_literal_scan_finds_a_planted_default() -> None:
    planted = ast.parse('"""sm_121 in a docstring is prose."""\nGPU = "sm_121"\n'
                        'ARCH = f"for {x} only (12.1)"\nCUDA = "13.0"\nOK = "12.10 and sm_1210"\n')
    texts = [str(n.value) for n in _literals(planted) if DEFAULT_LITERAL.search(str(n.value))]
    assert sorted(texts) == [" only (12.1)", "13.0", "sm_121"]
