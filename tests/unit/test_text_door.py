"""Text out is a door (`core/console.py`): no other module prints, and no name from outside
reaches a person raw.  A file named with an OSC title sequence, a screen clear, a bidi
override and a newline that forges a line is audited; what the terminal gets has no control
character and no forged line; the Markdown summary keeps its table whole."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sm121_build.core.console import md, md_code, shown
from sm121_build.core.errors import Sm121Error

PACKAGE = Path(__file__).resolve().parents[2] / "sm121_build"
DOOR = "core/console.py"
# runs in the builder, its output is the log
OUTSIDE = {"jobs/payload/build_extensions.py",
           # `prove`'s children, run by the user's interpreter on the GPU's machine: the
           # standard library and torch only (the same contract); they print JSON lines
           # the job parses, and read the cubins and list the job wrote for them
           "jobs/payload/load_cubins.py", "jobs/payload/harness_fa2.py",
           "jobs/payload/harness_marlin.py", "jobs/payload/compare_outputs.py",
           "jobs/payload/harness_run.py", "jobs/payload/fa2_kernels.py",
           "jobs/payload/marlin_kernels.py", "jobs/payload/case_files.py"}
PRINTS = {"echo", "secho", "echo_via_pager", "print", "write"}
STREAMS = {"sys.stdout", "sys.stderr", "sys.__stdout__", "sys.__stderr__"}
HOSTILE = "k\x1b]0;pwned\x07\x1b[2J\u202etxt\nfake: all native | `x` [l](https:e).so"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _prints(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "print":
            found.append("print")
        elif isinstance(func, ast.Attribute) and func.attr in PRINTS:
            owner = ast.unparse(func.value)
            if owner == "click" or owner in STREAMS:
                found.append(ast.unparse(func))
    return found


def test_no_module_but_the_door_prints() -> None:
    strays = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in OUTSIDE or rel == DOOR:
            continue
        found = _prints(ast.parse(path.read_text()))
        if found:
            strays[rel] = found
    assert strays == {}, "print through core/console (say, note, notice, result)"


def test_the_scan_sees_a_print() -> None:
    assert _prints(ast.parse("click.echo(x)\nprint(y)\nsys.stderr.write(z)\nf.write(b)\n")) \
        == ["click.echo", "print", "sys.stderr.write"]


def test_shown_escapes_every_control_and_nothing_else() -> None:
    assert shown("a\nb\r\t\x1b[2J\x07\x7f\x9b\u202e\u2028ü✓") == \
        "a\\nb\\r\\t\\e[2J\\x07\\x7f\\x9b\\u202e\\u2028ü✓"
    assert not RAW.search(shown(HOSTILE)) and "\n" not in shown(HOSTILE)


def test_md_leaves_no_markup_and_one_line() -> None:
    text = md(HOSTILE)
    assert "\n" not in text and not RAW.search(text)
    assert re.search(r"(?<!\\)[|`\[\]()<>]", text) is None
    assert md_code("vllm/_C.abi3.so") == "`vllm/_C.abi3.so`"
    assert md_code("a`b|c") == "a\\`b\\|c"


def _audit(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "sm121_build", "audit", str(folder), *args],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_a_hostile_file_name_reaches_no_terminal_raw(plain_so: Path, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(plain_so, folder / HOSTILE)
    summary = tmp_path / "summary.md"
    done = _audit(folder, "--kernels", "--summary-md", str(summary))
    assert done.returncode == 0, done.stderr
    for text in (done.stdout, done.stderr):
        assert not RAW.search(text), text
        assert "fake: all native" not in text.splitlines()
        assert not any(line.startswith("fake") for line in text.splitlines())
    assert "\\e]0;pwned\\x07" in done.stdout
    table = summary.read_text().splitlines()
    rows = [line for line in table if line.startswith("|")]
    assert len(rows) == 3, table  # the header, its rule, the one file
    assert rows[-1].count("|") - rows[-1].count("\\|") == 7
    assert not any(line.startswith("fake") or "](https" in line for line in table)
    as_json = json.loads(_audit(folder, "--json").stdout)
    assert [b["name"] for b in as_json["binaries"]] == [HOSTILE]  # JSON stays exact


def test_no_listing_lets_a_name_forge_a_line(plain_so: Path, tmp_path: Path) -> None:
    """The table's rebuild reason and the cuobjdump listing's `# name` and file stems carry
    the name too (red team, issue #54): one line each, whatever the name holds."""
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(plain_so, folder / HOSTILE)
    shutil.copy(plain_so, folder / "second.so")
    for args in ((), ("--format", "cuobjdump")):
        done = _audit(folder, *args)
        assert done.returncode == 0, done.stderr
        assert not any(line.startswith("fake") for line in done.stdout.splitlines()), args
        assert not RAW.search(done.stdout), args


def test_a_name_cannot_command_a_ci_runner(plain_so: Path, tmp_path: Path) -> None:
    """A line a runner reads as a workflow command (`::error …::`, `::add-mask::`) cannot
    begin with a name; the tool's own annotation goes to stderr when stdout is JSON."""
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(plain_so, folder / "::error title=forged::pwned.so")
    done = _audit(folder)
    assert not [line for line in done.stdout.splitlines() if line.lstrip().startswith("::")]
    assert "\\x3a:error title=forged::pwned.so" in done.stdout
    env = {**os.environ, "GITHUB_ACTIONS": "true"}
    required = subprocess.run([sys.executable, "-m", "sm121_build", "audit", str(folder),
                               "--json", "--require", "native", "--target", "sm_75"],
                              capture_output=True, text=True, env=env, timeout=120,
                              check=False)
    assert required.returncode == 1
    json.loads(required.stdout)  # JSON alone on stdout
    assert "::error title=sm121-build::" in required.stderr


def test_old_workflow_commands_and_raw_bytes_are_escaped_too() -> None:
    """A runner also reads `##[error]…` anywhere in a line; a file name's bytes that are
    not UTF-8 (0x9b, a C1 CSI) reach Python as lone surrogates (red team)."""
    from sm121_build.core.console import _block, _line

    assert _line("x##[error]forged") == "x\\x23#[error]forged"
    assert _block("ok\n##[add-mask]x") == "ok\n\\x23#[add-mask]x"
    assert shown("a\udc9b2Jb\udc85c") == "a\\x9b2Jb\\x85c"
    assert md("$x^2$") == "\\$x^2\\$"


def test_json_carries_no_old_workflow_command(plain_so: Path, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(plain_so, folder / "x##[warning]pwn.so")
    done = _audit(folder, "--json")
    assert "##[" not in done.stdout
    assert json.loads(done.stdout)["binaries"][0]["name"] == "x##[warning]pwn.so"


# every sink that writes one line, given a value from outside
ONE_LINE_SINKS = ("report_error", "note", "notice", "result")
HUGE = "a%\x1b\u202eü" * (2 << 20)  # 10 MB: escaping makes a control character 6 bytes


@pytest.mark.parametrize("sink", ONE_LINE_SINKS)
def test_no_line_is_longer_than_the_bound_whatever_it_is_given(
        sink: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8 MB field of a manifest or a 2 MB label named in an error is not an 8 MB line
    (red team, issue #62): every line a one-line sink writes, the `::error::` annotation
    among them, is at most 4 KiB; the cut is said, and the message's tail (its hint) kept."""
    from sm121_build.core import console

    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    getattr(console, sink)(f"x.json: arch_list {HUGE} is not an arch list: give one")
    out, err = capsys.readouterr()
    lines = (out + err).splitlines()
    assert lines and all(len(line.encode("utf-8", "surrogatepass")) <= 4096 for line in lines)
    assert all("more bytes)" in line and line.endswith("give one") for line in lines
               if "x.json" in line)


def test_cut_says_what_it_left_out() -> None:
    from sm121_build.core.console import cut

    assert cut("abc") == "abc" and cut(12) == "12"
    assert cut("x" * 250) == "x" * 200 + "…(50 more bytes)"
    assert cut("ü" * 12, limit=10) == "ü" * 10 + "…(4 more bytes)"
    assert len(shown("\x1b" * 100_000)) < 1100 * 2 and len(md("[" * 100_000)) < 1100 * 2


def test_an_8_mb_manifest_value_is_one_short_error_line(tmp_path: Path) -> None:
    """`inject --artifacts` with a manifest whose arch_list is 8 MB: one `error:` line,
    bounded, naming the field."""
    folder = tmp_path / "artifacts"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({
        "format": 1, "files": {"x.so": {"sha256": "0" * 64}}, "vllm_version": "0.1",
        "vllm_commit": "c" * 40, "arch_list": "1" * (8 << 20)}))
    done = subprocess.run([sys.executable, "-m", "sm121_build", "inject", "--artifacts",
                           str(folder), "--base", "x:y"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == Sm121Error.exit_code
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and len(lines[0]) <= 4096, len(done.stderr)
    assert lines[0].startswith("error: ") and "arch_list '111" in lines[0]
    assert "(8388408 more bytes)" in lines[0]


ESCAPERS = {"md", "md_code"}


def _is_renderer(name: str) -> bool:
    return "markdown" in name or name.startswith("_md")


def _escaping(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and (node.func.id in ESCAPERS or _is_renderer(node.func.id)))


def _raw_markdown(tree: ast.AST) -> list[str]:
    """Values a Markdown renderer (a function named `*markdown*` or `_md*`) puts in an
    f-string other than through the escaper (`md`, `md_code`, another renderer); an
    f-string the escaper is given whole is escaped whole."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef) or not _is_renderer(function.name):
            continue
        escaped = {id(arg) for node in ast.walk(function) if _escaping(node)
                   for arg in ast.walk(node)}
        for node in ast.walk(function):
            if isinstance(node, ast.FormattedValue) and id(node) not in escaped \
                    and not _escaping(node.value):
                found.append(f"{function.name}: {ast.unparse(node.value)}")
    return found


def test_every_markdown_value_goes_through_the_escaper() -> None:
    """$GITHUB_STEP_SUMMARY is written by renderers alone, and each puts every value in
    through `md` or `md_code` (issue #62: a refusal's and a decision's reasons went in raw)."""
    renderers, raw = 0, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        renderers += sum(isinstance(n, ast.FunctionDef) and n.name == "markdown"
                         for n in ast.walk(tree))
        found = _raw_markdown(tree)
        if found:
            raw[path.relative_to(PACKAGE).as_posix()] = found
    assert renderers >= 2 and raw == {}


def test_the_markdown_scan_sees_a_raw_value() -> None:
    source = ("def markdown(r):\n    return f'| {md(r.a)} | {r.why} | {_md_x(r)} | "
              "{str(r.b)} | {md(f\"{r.c} → {r.d}\")} |'\n")
    assert _raw_markdown(ast.parse(source)) == ["markdown: r.why", "markdown: str(r.b)"]


def test_local_shows_the_compilers_message_escaped(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`local` runs the build script in this process, and the script (which may not import
    the package) prints with print(): a compiler message it quotes (`#error` with an OSC
    title, BEL, U+202E and backspaces) reaches stderr escaped, the script's own stdout too.
    The real script is run, with a stand-in cmake whose build prints that message."""
    from click.testing import CliRunner

    import sm121_build.cli as cli_module
    from devkit.helpers import DATA
    from sm121_build.jobs.payload import build_extensions

    source = Path(shutil.copytree(DATA / "vllm_like", tmp_path / "src"))
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    hostile = 'fp4.cu:1:2: error: #error "boom \x1b]0;pwned\x07 \u202e rev \x08\x08\x08BS"'
    cmake = tmp_path / "cmake"
    cmake.write_text(f"#!/bin/sh\n[ \"$1\" = --build ] || exit 0\n"
                     f"printf '%s\\n' '{hostile}'\nexit 1\n")
    cmake.chmod(0o755)
    real = build_extensions.main

    def with_stand_in_cmake(argv: list[str], *rest: object) -> int:
        return real([*argv, "--cmake", str(cmake)], *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(build_extensions, "main", with_stand_in_cmake)
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    done = CliRunner().invoke(cli_module.cli, ["local", "--source", str(source), "--out",
                                               str(tmp_path / "out"), "--no-patch"])
    assert done.exit_code == 5, done.output
    assert not RAW.search(done.output), repr(done.output)
    failed = [line for line in done.stderr.splitlines() if "build failed: compiler" in line]
    assert len(failed) == 1, done.stderr
    assert '#error "boom \\e]0;pwned\\x07 \\u202e rev \\x08\\x08\\x08BS"' in failed[0]
