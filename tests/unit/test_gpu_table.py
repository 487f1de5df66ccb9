"""GPUs are data (`sm121_build/data/gpus.yaml`), read once into `cuda/compat.GPU_TABLE`: the
default GPU, its driver, platform and source rules come from the table, and no module
outside `cuda/` decides by comparing a GPU with sm_121 (`== SM121`, `== SPARK`, a literal
`"sm_121"`): it asks the GPU value (`is_default`, `has_source_rules`, `facts`)."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

import sm121_build
from sm121_build.cuda.binary import DEFAULT_DRIVER, SPARK, gpu_policy
from sm121_build.cuda.compat import GPU_TABLE, KNOWN_ARCHS, SM121, is_default_gpu

PACKAGE = Path(sm121_build.__file__).parent
GPU_NAMES = {"SM121", "SPARK"}


def test_the_table_is_the_one_source_of_gpu_facts() -> None:
    raw = yaml.safe_load((PACKAGE / "data" / "gpus.yaml").read_text())
    assert set(raw) == set(GPU_TABLE) == KNOWN_ARCHS
    (default,) = [arch for arch, row in raw.items() if row.get("default")]
    assert str(SM121) == f"sm_{default.replace('.', '')}" and SPARK.target == SM121
    assert tuple(int(p) for p in raw[default]["driver"].split(".")) == DEFAULT_DRIVER
    assert SPARK.is_default and SPARK.has_source_rules and is_default_gpu("sm_121")
    hopper = gpu_policy("sm_90")
    assert not hopper.is_default and not hopper.has_source_rules
    assert hopper.target.facts.first_cuda == raw["9.0"]["first_cuda"]
    assert SM121.facts.platform == "linux/arm64" and SM121.facts.machine


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
