"""build_extensions' air-gapped settings and the real-build benchmark's skip path."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sm121_build.jobs.payload import build_extensions
from sm121_build.verify.checks import kernel_key

ROOT = Path(__file__).resolve().parents[2]


def test_offline_points_external_projects_at_stand_ins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in build_extensions.EXTERNAL_PROJECTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_FLASH_ATTN_SRC_DIR", "/opt/flash-attn")
    env, defines = build_extensions.offline_settings(tmp_path)
    assert defines == ["FETCHCONTENT_FULLY_DISCONNECTED=ON"]
    assert set(env) == {"FLASH_MLA_SRC_DIR", "QUTLASS_SRC_DIR", "TRITON_KERNELS_SRC_DIR"}
    assert (Path(env["FLASH_MLA_SRC_DIR"]) / "flash_mla/flash_mla_interface.py").is_file()
    qutlass = sorted(p.name for p in (Path(env["QUTLASS_SRC_DIR"]) / "qutlass/csrc").iterdir())
    assert "gemm.cu" in qutlass and "bindings.cpp" in qutlass and len(qutlass) == 7
    assert "QuTLASS kernels are left out" in capsys.readouterr().err
    monkeypatch.setenv("QUTLASS_SRC_DIR", "/opt/qutlass")
    env, _ = build_extensions.offline_settings(tmp_path / "again")
    assert "QUTLASS_SRC_DIR" not in env
    assert "QuTLASS" not in capsys.readouterr().err


def test_offline_finds_the_projects_a_release_added(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.24.0 added cmake/external_projects/deepgemm.cmake and fmha_sm100.cmake, each
    reading its own ENV{..._SRC_DIR}; a fixed list let configure try to clone them."""
    source = tmp_path / "src"
    projects = source / "cmake" / "external_projects"
    projects.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("include(cmake/external_projects/deepgemm.cmake)\n")
    (projects / "deepgemm.cmake").write_text(
        'if(DEFINED ENV{DEEPGEMM_SRC_DIR})\n  set(DEEPGEMM_SRC_DIR $ENV{DEEPGEMM_SRC_DIR})\n')
    (projects / "fmha_sm100.cmake").write_text('set(X "$ENV{FMHA_SM100_SRC_DIR}")\n')
    (projects / "cutlass.cmake").write_text('set(C $ENV{VLLM_CUTLASS_SRC_DIR})\n')
    for name in (*build_extensions.EXTERNAL_PROJECTS, "DEEPGEMM_SRC_DIR", "FMHA_SM100_SRC_DIR"):
        monkeypatch.delenv(name, raising=False)
    env, _ = build_extensions.offline_settings(tmp_path / "build", source)
    assert {"DEEPGEMM_SRC_DIR", "FMHA_SM100_SRC_DIR"} <= set(env)
    assert "VLLM_CUTLASS_SRC_DIR" not in env  # CUTLASS must be real: --cutlass
    assert all(Path(path).is_absolute() and Path(path).is_dir() for path in env.values())


def test_cutlass_from_the_pypi_wheel_layout(tmp_path: Path) -> None:
    wheel = tmp_path / "nvidia_cutlass-4.2.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("cutlass_library/__init__.py", "")
        zf.writestr("cutlass_library/source/include/cutlass/cutlass.h", "#pragma once\n")
        zf.writestr("cutlass_library/source/tools/util/include/cutlass/util/x.h", "\n")
    env, defines = build_extensions.cutlass_settings(wheel, tmp_path / "unpacked")
    source = tmp_path / "unpacked" / "cutlass_library" / "source"
    assert env["VLLM_CUTLASS_SRC_DIR"] == str(source)
    assert f"CUTLASS_INCLUDE_DIR={source}/include" in defines
    with pytest.raises(build_extensions.ScriptError, match="nvidia-cutlass wheel"):
        build_extensions.cutlass_settings(tmp_path, tmp_path / "x")


def test_in_process_the_script_returns_and_leaves_the_environment_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sm121-build local` calls main() in-process: a bad input is a return code, not SystemExit,
    and the caller's os.environ is not changed (the compile steps get a copy)."""
    import os

    before = dict(os.environ)
    environ = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    code = build_extensions.main(["--source", str(tmp_path), "--out", str(tmp_path / "out"),
                                  "--target", "_C", "--offline", "--stand-in", "X_SRC_DIR",
                                  "--cutlass", str(tmp_path)], environ)
    assert code == 1
    assert "is neither a CUTLASS checkout nor an nvidia-cutlass wheel" in capsys.readouterr().err
    assert dict(os.environ) == before


def test_kernel_key_blanks_nvccs_per_build_hash() -> None:
    a = "_ZN45_INTERNAL_2400c3dc_14_gguf_kernel_cu_cd24131917vec_dot_q2_KEv"
    b = "_ZN45_INTERNAL_11d1e1ac_14_gguf_kernel_cu_cd24131917vec_dot_q2_KEv"
    assert kernel_key(a) == kernel_key(b) != a
    assert len(kernel_key(a)) == len(a)  # the mangled length prefix stays true
    assert kernel_key("_Z6rmsnormPf") == "_Z6rmsnormPf"


def test_real_build_benchmark_skips_with_a_reason_without_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed here: tests/integration/test_real_build.py runs it")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_build.py"), "--sdist", "x.tar.gz",
         "--cutlass", "x.whl", "--work", "/nonexistent", "--report", "/nonexistent"],
        capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout.strip()) == (0, "skipped: torch is not installed")


def test_stand_ins_hold_the_files_their_project_cmake_names(tmp_path: Path) -> None:
    """0.33.0's flashmla.cmake lists 63 files under ${flashmla_SOURCE_DIR}; CMake checks
    each exists even for a target never built, so the empty stand-in gets them (and never a
    path outside it, nor the tree's own ${CMAKE_SOURCE_DIR} files)."""
    source = tmp_path / "src"
    (source / "cmake" / "external_projects").mkdir(parents=True)
    (source / "cmake" / "external_projects" / "mla.cmake").write_text(
        "if (DEFINED ENV{MLA_SRC_DIR})\n  set(MLA_SRC_DIR $ENV{MLA_SRC_DIR})\nendif()\n"
        "set(S ${mla_SOURCE_DIR}/csrc/api/api.cpp\n  ${mla_SOURCE_DIR}/csrc/sm90/k.cu\n"
        "  ${mla_SOURCE_DIR}/../escape.cu ${CMAKE_SOURCE_DIR}/tools/x.py)\n")
    found = build_extensions.stand_in_sources(source)
    assert found == {"MLA_SRC_DIR": ("csrc/api/api.cpp", "csrc/sm90/k.cu", "../escape.cu")}
    env = build_extensions.stand_ins(tmp_path / "build", ["MLA_SRC_DIR"], environ={},
                                     files=found)
    empty = Path(env["MLA_SRC_DIR"])
    assert (empty / "csrc" / "api" / "api.cpp").is_file()
    assert (empty / "csrc" / "sm90" / "k.cu").is_file()
    assert not (empty.parent / "escape.cu").exists()


def test_the_payload_runs_alone_on_a_bare_python(tmp_path: Path) -> None:
    """The builder stage runs the copied file with the image's python3 and nothing else:
    isolated (-I), without site-packages (-S), from a folder of its own, it answers its
    interface (the command line) and refuses a missing source in one line."""
    import shutil
    import subprocess
    import sys

    from sm121_build.jobs.payload import PAYLOAD

    alone = Path(shutil.copy(PAYLOAD, tmp_path / "build_extensions.py"))
    shown = subprocess.run([sys.executable, "-I", "-S", str(alone), "--help"],
                           capture_output=True, text=True, check=False, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "--source" in shown.stdout and "--target" in shown.stdout
    missing = subprocess.run([sys.executable, "-I", "-S", str(alone), "--source",
                              str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"),
                              "--target", "_C"], capture_output=True, text=True, check=False,
                             cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode != 0 and "Traceback" not in missing.stderr, missing.stderr
