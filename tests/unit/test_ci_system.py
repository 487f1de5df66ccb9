"""`.ci/system` (CI's system set-up, which a user may run on their own machine) against
stubbed dpkg, apt-get, docker and dockerd: with Docker CE installed it never asks apt for
Debian's docker.io (which would remove Docker CE) and never starts a second engine; with a
socket it cannot use it says so; only a machine with no engine at all gets docker.io."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "system"


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\necho \"{name} $*\" >> \"$CALLS\"\n{body}")
    path.chmod(0o755)


def _machine(tmp_path: Path, installed: set[str], running: bool,
             dockerd: bool = False) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    listed = " ".join(sorted(installed))
    _stub(bin_dir, "dpkg-query", f'for p in {listed}; do [ "$3" = "$p" ] && '
          'printf "install ok installed" && exit 0; done\nexit 1\n')
    _stub(bin_dir, "apt-get", "exit 0\n")
    _stub(bin_dir, "docker", f"exit {0 if running else 1}\n")
    _stub(bin_dir, "sudo", '"$@"\n')
    _stub(bin_dir, "sleep", "exit 0\n")
    _stub(bin_dir, "g++", "exit 0\n")  # the wait for an engine that never answers: no wait
    if dockerd:
        _stub(bin_dir, "dockerd", "exit 0\n")
    (bin_dir / "python3").symlink_to(Path(sys.base_prefix) / "bin" / "python3")
    for tool in ("id", "seq", "sh", "nohup", "env", "cat"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    # the one place the script may look for an engine's socket: in the test's folder
    return {"PATH": str(bin_dir), "CALLS": str(tmp_path / "calls"), "HOME": str(tmp_path),
            "SM121_CI_SOCKETS": f"{tmp_path}/run/docker.sock"}


def _run(env: dict[str, str]) -> tuple[int, str, list[str]]:
    done = subprocess.run(["/bin/bash", str(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=120, check=False, cwd=ROOT)
    calls = Path(env["CALLS"]).read_text().splitlines() if os.path.exists(env["CALLS"]) \
        else []
    return done.returncode, done.stdout + done.stderr, calls


EVERYTHING = {"docker-registry", "debootstrap", "shellcheck", "git", "openssl"}


def test_docker_ce_running_is_used_and_nothing_conflicting_is_installed(
        tmp_path: Path) -> None:
    code, out, calls = _run(_machine(tmp_path, {"docker-ce"}, running=True))
    assert code == 0, out
    installs = [c for c in calls if c.startswith("apt-get install")]
    assert installs and "docker.io" not in installs[0], calls
    assert not any(c.startswith(("dockerd", "nohup")) for c in calls), calls


def test_docker_ce_stopped_is_the_users_to_start(tmp_path: Path) -> None:
    code, out, calls = _run(_machine(tmp_path, {"docker-ce", *EVERYTHING}, running=False,
                                     dockerd=True))
    assert code == 1
    assert "docker-ce is installed but its engine is not running" in out
    assert not any(c.startswith(("dockerd", "apt-get")) for c in calls), calls
    assert not any(c.startswith("apt-get") for c in calls), calls


def test_a_socket_this_user_cannot_use_is_said_not_duplicated(tmp_path: Path) -> None:
    import socket

    env = _machine(tmp_path, set(EVERYTHING), running=False, dockerd=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(run_dir / "docker.sock"))
    listener.listen()
    try:
        code, out, calls = _run(env)
    finally:
        listener.close()
    assert code == 1
    if os.getuid() == 0:
        assert "fails there" in out and "no second engine" in out
    else:
        assert "cannot use it" in out and "docker group" in out
    assert not any(c.startswith("dockerd") or (c.startswith("apt-get install")
                                                and "docker.io" in c) for c in calls), calls


def test_a_machine_with_no_engine_gets_debians(tmp_path: Path) -> None:
    code, _out, calls = _run(_machine(tmp_path, set(EVERYTHING), running=False))
    installs = [c for c in calls if c.startswith("apt-get install")]
    assert installs and installs[0].endswith("docker.io"), calls
    assert code != 0  # the stubbed dockerd never answers: the script says so and stops


def test_a_stale_socket_is_no_engine_and_debians_engine_is_started(tmp_path: Path) -> None:
    """A socket file nothing listens on (a machine image made with the engine running, as on
    CI's fresh machines) is no engine: docker.io's dockerd is started, which replaces it."""
    import socket

    env = _machine(tmp_path, {"docker.io", *EVERYTHING}, running=False, dockerd=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run_dir / "docker.sock"))  # bound, never listening: connect is refused
    try:
        _code, out, calls = _run(env)
    finally:
        stale.close()
    assert "no engine behind it" in out, out
    assert "cannot use it" not in out and "fails there" not in out, out
    assert any(c.startswith("nohup dockerd") or c.startswith("dockerd") for c in calls), calls


def test_a_stale_socket_beside_docker_ce_is_the_users_to_start(tmp_path: Path) -> None:
    import socket

    env = _machine(tmp_path, {"docker-ce", *EVERYTHING}, running=False, dockerd=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run_dir / "docker.sock"))
    try:
        code, out, calls = _run(env)
    finally:
        stale.close()
    assert code == 1
    assert "docker-ce is installed but its engine is not running" in out, out
    assert not any(c.startswith("dockerd") for c in calls), calls


# -- red team round 5 --------------------------------------------------------------------------
@pytest.mark.parametrize("named", [{"DOCKER_HOST": "tcp://10.0.0.5:2376"},
                                   {"DOCKER_HOST": "ssh://me@build-host"},
                                   {"DOCKER_CONTEXT": "remote"}])
def test_an_engine_the_user_names_is_theirs_and_nothing_is_installed_for_it(
        tmp_path: Path, named: dict[str, str]) -> None:
    """A remote engine (DOCKER_HOST tcp:// or ssh://, a context) that answers, with only
    Docker's CLI installed: docker.io (which conflicts with docker-ce-cli) is never asked
    for; when it does not answer, no local engine is started in its place."""
    env = {**_machine(tmp_path, {"docker-ce-cli", *EVERYTHING}, running=True), **named}
    code, out, calls = _run(env)
    assert code == 0, out
    assert not any(c.startswith("apt-get install") and "docker.io" in c for c in calls), calls
    (tmp_path / "calls").unlink(missing_ok=True)
    down = tmp_path / "down"
    down.mkdir()
    env = {**_machine(down, {"docker.io", *EVERYTHING}, running=False, dockerd=True), **named}
    code, out, calls = _run(env)
    assert code == 1 and "does not answer" in out and "starts no engine" in out, out
    assert not any(c.startswith(("dockerd", "nohup")) for c in calls), calls


def test_a_docker_context_chosen_in_the_users_config_is_theirs(tmp_path: Path) -> None:
    env = _machine(tmp_path, {"docker.io", *EVERYTHING}, running=False, dockerd=True)
    (tmp_path / ".docker").mkdir()
    (tmp_path / ".docker" / "config.json").write_text('{"currentContext": "spark"}')
    code, out, calls = _run(env)
    assert code == 1 and "docker context chosen in" in out, out
    assert not any(c.startswith(("dockerd", "nohup")) for c in calls), calls


def test_a_package_removed_with_its_configuration_left_is_not_installed(
        tmp_path: Path) -> None:
    """`dpkg -s` succeeds for "deinstall ok config-files": git and docker-ce so removed
    are missing (git is installed; docker-ce is no engine to wait for)."""
    env = _machine(tmp_path, {"docker-registry", "debootstrap", "shellcheck", "openssl"},
                   running=False, dockerd=True)
    query = Path(env["PATH"]) / "dpkg-query"
    query.write_text(query.read_text().replace(
        "exit 1\n", 'case "$3" in git|docker-ce) printf "deinstall ok config-files"; exit 0;; '
        "esac\nexit 1\n", 1))
    _code, out, calls = _run(env)
    installs = [c for c in calls if c.startswith("apt-get install")]
    assert installs and " git" in installs[0], calls
    assert "docker-ce is installed" not in out, out


def test_no_home_and_no_sudo_are_one_line_each(tmp_path: Path) -> None:
    env = _machine(tmp_path, {"docker-ce", *EVERYTHING}, running=True)
    del env["HOME"]
    code, out, _calls = _run(env)
    assert code == 0 and "unbound variable" not in out, out
    bare = tmp_path / "bare"
    bare.mkdir()
    env = _machine(bare, {"docker-ce"}, running=True)
    (Path(env["PATH"]) / "sudo").unlink()
    (Path(env["PATH"]) / "id").unlink()
    _stub(Path(env["PATH"]), "id", 'case "$1" in -u) echo 1000;; -un) echo alice;; esac\n')
    code, out, _calls = _run(env)
    assert code == 1 and "needs root, and there is no sudo here" in out, out
