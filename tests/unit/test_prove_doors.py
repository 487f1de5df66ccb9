"""Issue 62: `prove` and proof documents at the doors.

- every path option a command READS is an input of the outputs door (`cli.params.InputPath`,
  `--python`): no `--json`, `--out`, `--report` is written over, into or through it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import pytest

from devkit.fake_gpu import fake_python
from devkit.helpers import cli, one_line_error
from devkit.keys import key_pair
from sm121_build.cli import cli as root
from sm121_build.cli.params import InputPath, interpreter_value

# the path options that name what a command WRITES: every other path option is read
OUTPUTS = {"out", "report", "summary_md", "json_out"}


def _commands(group: click.Command, prefix: str = "") -> list[tuple[str, click.Command]]:
    found = [(prefix or "sm121-build", group)]
    if isinstance(group, click.Group):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            assert command is not None
            found += _commands(command, f"{prefix} {name}".strip())
    return found


def test_every_path_option_that_is_read_is_an_input() -> None:
    """A scan of the CLI: a path option is an output (`OUTPUTS`) or an `InputPath`, which
    declares it an input of the outputs door; `--python` (a name or a path) is declared by
    its callback."""
    paths, pythons = [], []
    for where, command in _commands(root):
        for param in command.params:
            if param.name == "python":
                pythons.append(where)
                assert param.callback is interpreter_value, where
            if isinstance(param.type, click.Path) and param.name not in OUTPUTS:
                paths.append(f"{where} {param.name}")
                assert isinstance(param.type, InputPath), f"{where} {param.name} is read " \
                    "but not declared an input (cli.params.InputPath)"
    assert pythons == ["prove"]
    assert {"prove files", "prove stock", "prove sign_key", "kernels publish trust_key",
            "kernels attest proof", "aot cuda_home"} <= set(paths)


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return tmp_path / "a", tmp_path / "b"


def test_prove_json_onto_its_own_key_is_refused(folders: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    """Red team (issue 62): `prove --json K.pem --sign-key K.pem` replaced the private key
    with the proof, exit 0."""
    private, _public = key_pair(tmp_path, "k")
    fake = fake_python(tmp_path / "FAKE-python", sys.executable)
    before = private.read_bytes()
    for out in (private, tmp_path / "." / private.name):
        line = one_line_error(cli("prove", "--files", str(folders[0]), "--stock",
                                  str(folders[1]), "--python", str(fake), "--json", str(out),
                                  "--sign-key", str(private)))
        assert "is the same file as the input" in line and "nothing to prove" not in line
    assert private.read_bytes() == before


def test_prove_json_onto_its_interpreter_is_refused(folders: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    fake = fake_python(tmp_path / "FAKE-python", sys.executable)
    before = fake.read_bytes()
    line = one_line_error(cli("prove", "--files", str(folders[0]), "--stock", str(folders[1]),
                              "--python", str(fake), "--json", str(fake)))
    assert "is the same file as the input" in line
    assert fake.read_bytes() == before


def test_aot_out_inside_its_cuda_home_is_refused(tmp_path: Path) -> None:
    home, so = tmp_path / "cuda", tmp_path / "x.so"
    (home / "bin").mkdir(parents=True)
    so.write_bytes(b"\x7fELF")
    line = one_line_error(cli("aot", str(so), "--out", str(home / "out"), "--cuda-home",
                              str(home)))
    assert "is inside the input" in line
    assert not (home / "out").exists()
