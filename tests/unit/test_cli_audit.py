"""`sm121-build audit` output formats on real nvcc output."""

from __future__ import annotations

import json
from pathlib import Path

from devkit.helpers import cli, run_cuobjdump


def test_table(plain_so: Path) -> None:
    result = cli("audit", str(plain_so))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "target sm_121, CUDA driver 13.0" in out
    assert "sm_121 x2" in out and "sm_121a x2" in out
    assert "kernels  4: 4 native, 0 JIT only, 0 with no loadable code" in out


def test_kernels_list_and_jit_verdict(matrix: dict[str, Path]) -> None:
    result = cli("audit", "--kernels", str(matrix["lz4"]), "--target", "sm_100")
    assert result.returncode == 0, result.stderr
    # sm_90 cubins do not load on sm_100, the compute_90 PTX does (JIT)
    assert "jit    _Z7add_onePfi" in result.stdout
    assert "loads through PTX JIT" in result.stdout


def test_ptx_isa_newer_than_driver(matrix: dict[str, Path]) -> None:
    result = cli("audit", "--json", "--driver", "12.8", "--target", "sm_100",
                 str(matrix["lz4"]))
    data = json.loads(result.stdout)["binaries"][0]
    assert data["verdict"] == "none"  # PTX 9.0 from CUDA 13 cannot JIT on a 12.8 driver


def test_json_entries(matrix: dict[str, Path]) -> None:
    result = cli("audit", "--json", str(matrix["family"]))
    data = json.loads(result.stdout)
    binary = data["binaries"][0]
    assert binary["cubins"] == {"sm_100f": 2, "sm_120f": 2}
    assert binary["verdict"] == "native"
    assert {e["cuobjdump_arch"] for e in binary["entries"] if e["kind"] == "elf"} == {
        "sm_100", "sm_120"}
    assert binary["kernel_counts"] == {"native": 4, "jit": 0, "none": 0}


def test_cuobjdump_format_single_file_is_exact(matrix: dict[str, Path]) -> None:
    for name in ("plain", "ptx_only", "zstd"):
        ours = cli("audit", "--format", "cuobjdump", str(matrix[name]))
        assert ours.stdout == run_cuobjdump("-lelf", "-lptx", str(matrix[name])).stdout


def test_cuobjdump_format_several_files(matrix: dict[str, Path], tmp_path: Path) -> None:
    for name in ("sm90", "sm121"):
        (tmp_path / f"{name}.so").write_bytes(matrix[name].read_bytes())
    out = cli("audit", "--format", "cuobjdump", str(tmp_path)).stdout.splitlines()
    assert out[0] == "# sm121.so" and out[1] == "ELF file    1: sm121.1.sm_121.cubin"
    header = out.index("# sm90.so")
    assert out[header + 1] == "ELF file    1: sm90.1.sm_90.cubin"


def test_summary_markdown(matrix: dict[str, Path], tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    result = cli("audit", "--summary-md", str(summary), str(matrix["sm90"]))
    assert result.returncode == 0
    text = summary.read_text()
    # (Markdown-escaped: `\_` and `\-` are shown `_` and `-`)
    assert "| .so | cubins per arch | PTX | sm\\_121 | kernels loadable on sm\\_121 |" in text
    assert "sm\\_90 x2 | \\- | none | 0 of 4 |" in text


COMMANDS = ("build", "local", "inject", "audit", "pin", "patch", "dockerfile", "prune",
            "doctor", "kernels", "aot", "prove")


def test_help_lists_every_command_and_each_has_its_own() -> None:
    result = cli("--help")
    assert result.returncode == 0
    listed = {line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines()
              if line.strip()}
    assert listed == set(COMMANDS)
    for command in COMMANDS:
        own = cli(command, "--help")
        assert own.returncode == 0, own.stderr
        assert own.stdout.startswith(f"Usage: sm121-build {command} "), command
