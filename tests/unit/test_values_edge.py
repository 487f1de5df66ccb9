"""Values you are given (issue 54, class B): every value checked at the edge, before any work.

- a duration (`aot --timeout`, the SM121_*_TIMEOUT limits) is finite, above 0 and at most a
  day, one rule for both: `inf`, `1e300`, `nan` are one line, never a traceback or a limit of
  "nan s"
- an empty value is refused the same way on every command (never the default, the current
  folder, or "not given")
- a GPU comes from one table (`compat.KNOWN_ARCHS`, the arch lists' table): `sm_999` is
  refused at the edge, never by ptxas once per module

Draft for tests/unit/ (the real CLI; DOCKER_HOST points nowhere, so a value that reaches the
engine shows as exit 4, not 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sm121_build
from devkit.helpers import DATA, cli, compile_cached, cuda_home, gencode, one_line_error
from sm121_build.core.errors import Sm121Error

PACKAGE_ROOT = Path(sm121_build.__file__).resolve().parents[1]  # run from another folder
ENV = {"CUDA_HOME": str(cuda_home()), "DOCKER_HOST": "unix:///nonexistent.sock"}
RULE = "expected a number of seconds above 0 and at most 86400"


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    return {**ENV, "XDG_CACHE_HOME": f"{tmp_path}/cache", "XDG_STATE_HOME": f"{tmp_path}/state"}


# -- 5. durations ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "-inf", "0", "-1", "86401", "soon",
                                   "1_0", "1e3", "0x10", ".5", "1.2.3"])
def test_a_timeout_that_is_not_a_bounded_duration_is_refused_first(
        value: str, tmp_path: Path, home: dict[str, str]) -> None:
    """Refused while the command line is read: the input (no ELF file) is never opened."""
    (tmp_path / "x.so").write_bytes(b"not read\n")
    line = one_line_error(cli("aot", str(tmp_path / "x.so"), "--out", str(tmp_path / "o"),
                              "--timeout", value, env=home), alone=True)
    assert f"'--timeout': {value!r}: {RULE}" in line


def test_the_option_and_the_environment_keep_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from sm121_build.cli.params import seconds_value
    from sm121_build.core.limits import Limits, seconds

    for value in ("inf", "1e300", "nan", "0", "86401"):
        with pytest.raises(ValueError, match=RULE):
            seconds(value)
        monkeypatch.setenv("SM121_ENGINE_TIMEOUT", value)
        with pytest.raises(Sm121Error, match=RULE):
            Limits.from_environment()
    assert seconds("86400") == 86400.0 and seconds_value(None, None, "1.5") == 1.5


# -- 6. values at the edge: empty strings, GPU targets ---------------------------------------


@pytest.mark.parametrize("args, option", [
    (["aot", "vllm/vllm-openai:v0.33.0", "--gpu", ""], "--gpu"),
    (["aot", "vllm/vllm-openai:v0.33.0", "--target="], "--target"),
    (["aot", "vllm/vllm-openai:v0.33.0", "--tag", ""], "--tag"),
    (["aot", "x.so", "--out", ""], "--out"),
    (["audit", "x.so", "--target", ""], "--target"),
    (["audit", "x.so", "--driver", ""], "--driver"),
    (["build", "--base", "vllm/vllm-openai:v0.33.0", "--tag", ""], "--tag"),
    (["build", "--base", "vllm/vllm-openai:v0.33.0", "--gpu", ""], "--gpu"),
    (["build", "--base", "vllm/vllm-openai:v0.33.0", "--arch", ""], "--arch"),
    (["inject", "--base", "x:y", "--artifacts", ".", "--gpu", ""], "--gpu"),
    (["kernels", "publish", "--artifacts", ".", "--to", ""], "--to"),
])
def test_an_empty_value_is_refused_the_same_way_everywhere(
        args: list[str], option: str, tmp_path: Path,
        home: dict[str, str]) -> None:
    (tmp_path / "x.so").write_bytes(b"not read\n")
    done = cli(*[str(tmp_path / a) if a == "x.so" else a for a in args], env=home)
    line = one_line_error(done, alone=True)
    assert line.startswith(f"error: an empty value for {option}: give a value, or leave the "
                           "option out for its default"), line


@pytest.mark.slow
def test_an_empty_out_never_writes_into_the_current_folder(
        tmp_path: Path, home: dict[str, str]) -> None:
    """`--out ""` was Path("") (the current folder): the rewritten file landed there."""
    jit_so = compile_cached("doors_jit", DATA / "kernels.cu",
                            [*gencode("compute_80:compute_80", "compute_80:sm_80"),
                             "--compress-mode=none"])
    work = tmp_path / "cwd"
    work.mkdir()
    done = subprocess.run([sys.executable, "-m", "sm121_build", "aot", str(jit_so), "--out",
                           "", "--target", "sm_121"], cwd=work, capture_output=True,
                          text=True, check=False,
                          env={**os.environ, **home, "PYTHONPATH": str(PACKAGE_ROOT)})
    one_line_error(done, alone=True)
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("args", [
    ["aot", "x.so", "--out", "o", "--target", "sm_999"],
    ["aot", "vllm/vllm-openai:v0.33.0", "--gpu", "sm_999"],
    ["audit", "x.so", "--target", "sm_999"],
    ["audit", "x.so", "--target", "12.9"],
    ["build", "--base", "vllm/vllm-openai:v0.33.0", "--gpu", "sm_130"],
])
def test_a_gpu_no_cuda_knows_is_refused_before_any_work(
        args: list[str], tmp_path: Path, home: dict[str, str]) -> None:
    (tmp_path / "x.so").write_bytes(b"not read\n")
    done = cli(*[str(tmp_path / a) if a in ("x.so", "o") else a for a in args], env=home)
    line = one_line_error(done, alone=True)
    assert "unknown GPU target" in line and "sm_121" in line, line
    assert "ptxas" not in done.stderr


def test_gpu_targets_come_from_the_one_table() -> None:
    from sm121_build.cli.params import arch_list
    from sm121_build.cuda.compat import KNOWN_ARCHS, parse_target

    assert str(arch_list(None, None, "12.1")) == "12.1"  # arch lists check the same table
    for arch in KNOWN_ARCHS:
        assert str(parse_target(arch)) == f"sm_{arch.replace('.', '')}"
    for text in ("sm_30", "sm_999", "sm_122", "12.9", "13.0", ""):
        with pytest.raises(Sm121Error, match="unknown GPU target"):
            parse_target(text)


def test_the_driver_and_cuda_versions_are_checked_before_any_work(
        tmp_path: Path, home: dict[str, str]) -> None:
    """`audit --cuda` was read only after the audit began."""
    (tmp_path / "x.so").write_bytes(b"not read\n")
    for option in ("--driver", "--cuda"):
        line = one_line_error(cli("audit", str(tmp_path / "x.so"), "--target", "sm_121",
                                  option, "1x", env=home), alone=True)
        assert f"Invalid value for '{option}'" in line, line


@pytest.mark.parametrize("value", [" ", "\t", "  "])
def test_whitespace_alone_is_an_empty_value(value: str, tmp_path: Path) -> None:
    """`--summary-md ' '` wrote a file named ' ' in the current folder (red team)."""
    done = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "/bin/ls",
                           f"--summary-md={value}"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, check=False)
    assert done.returncode == 2 and "an empty value for --summary-md" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [("--target", "sm_\u0661\u0662\u0661"),
                                  ("--target", "\uff11\uff12\uff11"),
                                  ("--driver", "\u0661\u0663.0")])
def test_digits_are_ascii_digits(args: tuple[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "/bin/ls", *args],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr


def test_a_duration_in_other_digits_is_refused() -> None:
    from sm121_build.core.limits import seconds

    with pytest.raises(ValueError):
        seconds("\u0661\u0662")


def test_a_bad_time_limit_is_refused_by_every_command() -> None:
    """`audit FILE` never asks the engine, yet refuses SM121_ENGINE_TIMEOUT=nan as `prune`
    does: one rule, at the edge (red team)."""
    done = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "/bin/ls"],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "SM121_ENGINE_TIMEOUT": "nan"})
    assert done.returncode == 2
    assert done.stderr.startswith("error: SM121_ENGINE_TIMEOUT='nan'")


def test_a_version_file_nested_past_the_parser_is_no_traceback() -> None:
    from sm121_build.core.vllm import read_version_file

    assert read_version_file("x=" + "-" * 200_000 + "1\n") == (None, None)
    assert read_version_file("x=" + "+".join(["1"] * 100_000) + "\n") == (None, None)


def test_an_unusable_state_folder_is_said_not_read_as_empty(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sm121_build.image import ledger

    (tmp_path / "state").write_text("a file where the state folder should be")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with pytest.raises(Sm121Error, match="the state folder cannot be used"):
        ledger.load()


@pytest.mark.parametrize("name,value", [("SM121_CMAKE_ON_HOST", "yes"),
                                        ("SM121_TRUST_KEY", " "),
                                        ("SM121_BUILD_REPO", "a\nb")])
def test_a_bad_sm121_variable_is_refused_by_every_command(name: str, value: str) -> None:
    """A variable that stands for an option is refused as the option would be, on every
    command, before any work (red team)."""
    done = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "/bin/ls"],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, name: value})
    assert done.returncode == 2 and done.stderr.startswith(f"error: {name}="), done.stderr


def test_a_ledger_entry_with_an_id_the_engine_never_gave_is_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image ID with a newline (a hand edit) never reaches an engine request (red team)."""
    import json as json_module

    from sm121_build.image import ledger

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    (tmp_path / "sm121-build").mkdir()
    (tmp_path / "sm121-build" / "ledger.json").write_text(json_module.dumps(
        {"format": 1, "built": [{"image_id": "sha256:aa\n::error::x", "tags": [],
                                 "base_id": "b", "at": 1.0}], "replaced": []}))
    with pytest.raises(Sm121Error):
        ledger.load()


def test_a_capability_not_of_the_x_y_form_is_no_gpu() -> None:
    from sm121_build.cuda.nvidia_smi import HostGpu

    assert HostGpu("GB10", "12.1", "580.95.05", "13.0").target == "sm_121"
    assert HostGpu("x", "580.95.05", "", None).target is None  # a lying nvidia-smi's column


def test_an_engine_that_answers_no_is_not_a_lost_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Docker SDK's APIError (a 404, a 500) is an OSError from the requests stack: the
    engine is there and said no, so the line gives its status and words (escaped), exit 2,
    never "lost the connection" (exit 4); a dropped connection keeps its own line."""
    import docker.errors
    import requests
    from click.testing import CliRunner

    import sm121_build.cli as cli_module

    answer = requests.Response()
    answer.status_code = 404

    def refuse() -> None:
        raise docker.errors.NotFound("404 Client Error", response=answer,
                                     explanation="No such image: x\x1b]0;owned\x07")

    monkeypatch.setattr(cli_module, "check_environment", refuse)
    done = CliRunner().invoke(cli_module.cli, ["prune", "--keep", "1"])
    assert done.exit_code == 2, done.output
    assert "error: the Docker engine answered 404: No such image: x" in done.output
    assert "\x1b" not in done.output and "lost the connection" not in done.output

    def cut() -> None:
        raise requests.exceptions.ConnectionError("Connection aborted.")

    monkeypatch.setattr(cli_module, "check_environment", cut)
    done = CliRunner().invoke(cli_module.cli, ["prune", "--keep", "1"])
    assert done.exit_code == 4 and "lost the connection" in done.output, done.output


@pytest.mark.parametrize("args", [("aot", "X", "--out", "O", "-j", "\u0661"),
                                  ("aot", "X", "--out", "O", "-j", "1_0"),
                                  ("aot", "X", "--out", "O", "-j", " 2"),
                                  ("prune", "--keep", "\uff12"),
                                  ("audit", "X", "--platform", "linux/amd\x1b"),
                                  ("audit", "X", "--platform", "arm64"),
                                  ("aot", "X", "--out", "O", "--timeout", "5\x1c")])
def test_counts_and_platforms_keep_the_rule_of_durations(args: tuple[str, ...],
                                                         tmp_path: Path) -> None:
    """Red team round 5: `-j ١`, `--keep ２`, `-j 1_0` were taken (click's int is Python's
    int()), `--platform` was never checked, `--timeout 5\\x1c` was stripped to 5: each is one
    line at the command line, before the input is opened."""
    named = [str(tmp_path / "x.so") if a == "X" else str(tmp_path / "o") if a == "O" else a
             for a in args]
    line = one_line_error(cli(*named, env={"DOCKER_HOST": "unix:///nonexistent.sock"}),
                          alone=True)
    assert "Invalid value for" in line


def test_a_platform_the_tarball_does_not_hold_is_refused_not_read_as_another(
        tmp_path: Path, jit_only_so: Path) -> None:
    """Red team round 5: `--platform linux/amd64` on a tarball of linux/arm64 alone (and an
    attestation) audited the arm64 image and said nothing."""
    from devkit.imagetar import oci_layout

    image = oci_layout(tmp_path / "one.tar", [{
        "usr/lib/python3/dist-packages/vllm/_C.abi3.so": jit_only_so.read_bytes()}])
    line = one_line_error(cli("audit", str(image), "--platform", "linux/amd64"))
    assert "holds no linux/amd64 image (it holds linux/arm64)" in line
    done = cli("audit", "--json", str(image), "--platform", "linux/arm64")
    assert done.returncode == 0, done.stderr
    two = oci_layout(tmp_path / "two.tar", [{"a.so": jit_only_so.read_bytes()}],
                     platforms=("linux/arm64", "linux/amd64"))
    assert "pick one with --platform" in one_line_error(cli("audit", str(two)))
    assert cli("audit", str(two), "--platform", "linux/amd64").returncode == 0


def test_a_lone_image_of_another_platform_is_refused_by_its_config(
        tmp_path: Path, jit_only_so: Path) -> None:
    """Red team round 6: a tarball whose one image names no platform in an index (`docker
    save`'s form) was read whatever `--platform` asked; its config says which it is."""
    from devkit.imagetar import docker_save

    image = docker_save(tmp_path / "saved.tar", [{
        "usr/lib/python3/dist-packages/vllm/_C.abi3.so": jit_only_so.read_bytes()}],
        architecture="amd64")
    line = one_line_error(cli("audit", str(image), "--platform", "linux/arm64"))
    assert "holds no linux/arm64 image (it holds linux/amd64)" in line
    assert cli("audit", "--json", str(image), "--platform", "linux/amd64").returncode == 0
    assert cli("audit", "--json", str(image)).returncode == 0


def test_a_banner_that_ends_at_cuda_version_names_no_cuda() -> None:
    """nvidia-smi's banner cut right after `CUDA Version:` (a lying nvidia-smi, or the
    children door's bound) names no CUDA version: the fallback (None), never an IndexError."""
    from sm121_build.cuda.nvidia_smi import driver_cuda, gpu_defaults

    banner = "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version:"
    for header in (banner, banner + "   \n", banner + " x.y", banner + " ."):
        assert driver_cuda(header) is None
    assert driver_cuda(banner + " 13.0 |") == "13.0"

    def smi(args: list[str]) -> str:
        return "NVIDIA GB10, 12.1, 580.95.05\n" if len(args) > 1 else banner

    assert gpu_defaults(lambda name: "/fake/nvidia-smi", smi) == ("sm_121", None)


def test_an_nvidia_smi_that_hangs_is_given_up_and_said(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Red team 3: a hanging or flooding nvidia-smi cost 20 s (twice in doctor) and nothing
    said why; now its deadline is SMI_S, the banner is not asked after a hang, and a note
    says the GPU is not known."""
    from sm121_build.cuda import nvidia_smi

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho called >> \"$0.calls\"\nexec sleep 60\n")
    smi.chmod(0o755)
    monkeypatch.setattr(nvidia_smi, "SMI_S", 0.5)
    assert nvidia_smi.gpu_defaults(lambda _name: str(smi)) == (None, None)
    assert (tmp_path / "nvidia-smi.calls").read_text().count("called") == 1
    assert "nvidia-smi gave no answer in 0.5 s" in capsys.readouterr().err
