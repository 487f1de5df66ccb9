"""One exit code per class of failure, each through the CLI as one `error:` line (README's
table).  Real inputs where the failure is ours to cause; the engine one points DOCKER_HOST at a
socket nothing listens on (a true boundary)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.helpers import DATA, ROOT, compile_cached, gencode
from sm121_build.core.errors import EXIT_CODES


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                          text=True, check=False, env={**os.environ, **(env or {})})


def _one_error(result: subprocess.CompletedProcess[str], code: int, starts: str) -> None:
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {starts}"), result.stderr
    assert "Traceback" not in result.stderr


def test_the_table_in_the_readme_is_the_table_in_the_code() -> None:
    readme = (ROOT / "README.md").read_text()
    for name, code in EXIT_CODES.items():
        assert f"| {code} | `{name}` |" in readme, name
    assert "| 130 |" in readme


def test_bad_input_is_2(tmp_path: Path) -> None:
    _one_error(_run("build", "--base", "UPPER/case"), 2, "'UPPER/case' is not a valid image")


def test_usage_is_2() -> None:
    _one_error(_run("audit"), 2, "Missing argument")


def test_audit_requirement_not_met_is_1(tmp_path: Path) -> None:
    so = compile_cached("exit-sm90", DATA / "kernels.cu", gencode("compute_90:sm_90"))
    _one_error(_run("audit", str(so), "--require", "native"), 1,
               "4 kernel(s) would not load as native on sm_121")
    _one_error(_run("audit", str(tmp_path), "--require", "jit"), 1, "--require jit: no ELF")


def test_engine_unavailable_is_4(tmp_path: Path) -> None:
    _one_error(_run("pin", "vllm/vllm-openai:latest",
                    env={"DOCKER_HOST": f"unix://{tmp_path}/nothing.sock"}), 4,
               "cannot reach the Docker engine")


def test_patch_drift_is_6(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(DATA / "vllm_like", source)
    text = (source / "CMakeLists.txt").read_text()
    (source / "CMakeLists.txt").write_text(text.replace(
        'cuda_archs_loose_intersection(FP4_ARCHS "12.0f" "${CUDA_ARCHS}")',
        'cuda_archs_loose_intersection(FP4_ARCHS "${NOT_SET_ANYWHERE}" "${CUDA_ARCHS}")', 1))
    _one_error(_run("patch", str(source), "--version", "0.19.1"), 6, "CMakeLists.txt:")


def test_build_failure_is_5(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(DATA / "vllm_like", source)
    (source / "csrc" / "ops.cu").write_text("this is not CUDA\n")
    from devkit.helpers import cuda_home

    home = cuda_home()
    result = _run("local", "--source", str(source), "--out", str(tmp_path / "out"),
                  env={"CUDA_HOME": str(home), "MAX_JOBS": "2",
                       "PATH": f"{home / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert result.returncode == 5, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: local build failed")


@pytest.mark.parametrize("code", sorted(set(EXIT_CODES.values())))
def test_every_class_has_its_own_code(code: int) -> None:
    assert list(EXIT_CODES.values()).count(code) == 1


def test_on_github_actions_an_error_is_also_an_annotation() -> None:
    result = _run("build", "--base", "UPPER/case", env={"GITHUB_ACTIONS": "true"})
    _one_error(result, 2, "'UPPER/case' is not a valid image")
    assert result.stdout.strip() == (
        "::error title=sm121-build::'UPPER/case' is not a valid image reference (expected "
        "NAME[:TAG][@DIGEST], e.g. vllm/vllm-openai:nightly)")
    assert "::error" not in _run("build", "--base", "UPPER/case").stdout


def test_a_step_ends_with_its_mark(capsys: pytest.CaptureFixture[str]) -> None:
    from sm121_build.core.console import Steps

    steps = Steps()
    with steps.step("inspect"):
        pass
    with pytest.raises(ValueError), steps.step("build"):
        raise ValueError("no")
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    assert [line.split(" (")[0] for line in lines] == [
        "==> inspect", "✓ inspect", "==> build", "✕ build"]


def test_no_module_shadows_the_standard_library() -> None:
    """With the package folder on sys.path (a script run from it), `import dataclasses` used
    to import the package's inspect.py instead of the standard library's."""
    result = subprocess.run([sys.executable, "-c", "import dataclasses, inspect, sys; "
                             "print(inspect.__file__)"], cwd=ROOT / "sm121_build",
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "sm121_build" not in result.stdout
    shadowing = sorted(p.stem for p in (ROOT / "sm121_build").glob("*.py")
                       if p.stem in sys.stdlib_module_names)
    assert shadowing == []


def test_a_closed_pipe_ends_quietly_with_the_sigpipe_status(tmp_path: Path) -> None:
    """`sm121-build audit … | head -1`: the reader went away; no `error:` line, status 141."""
    so = compile_cached("pipe", DATA / "kernels.cu", gencode("compute_80:sm_80"))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    done = subprocess.run([sys.executable, "-m", "sm121_build", "audit", str(so), "--target",
                           "sm_121", "--driver", "13.0", "--kernels"], stdout=write,
                          stderr=subprocess.PIPE, text=True, check=False)
    os.close(write)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""
