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
    _stub(bin_dir, "dpkg", f'for p in {listed}; do [ "$2" = "$p" ] && exit 0; done\nexit 1\n')
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
    # DOCKER_HOST names the one engine the script may look for: a socket in the test's folder
    return {"PATH": str(bin_dir), "CALLS": str(tmp_path / "calls"), "HOME": str(tmp_path),
            "DOCKER_HOST": f"unix://{tmp_path}/run/docker.sock"}


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
