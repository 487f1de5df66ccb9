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
    for tool in ("id", "seq", "sh", "nohup", "env", "cat", "timeout", "mktemp"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    # the one place the script may look for an engine's socket: in the test's folder
    return {"PATH": str(bin_dir), "CALLS": str(tmp_path / "calls"), "HOME": str(tmp_path),
            "SM121_CI_SOCKETS": f"{tmp_path}/run/docker.sock"}


def _run(env: dict[str, str], command: list[str] | None = None,
         cwd: Path = ROOT) -> tuple[int, str, list[str]]:
    done = subprocess.run(command or ["/bin/bash", str(SCRIPT)], capture_output=True,
                          text=True, env=env, timeout=120, check=False, cwd=cwd)
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


# -- issue #62 ---------------------------------------------------------------------------------
# A /tmp of the script's own (a private mount namespace, as root): a new tmpfs, the test's
# folder bound into it at its own path, moved onto /tmp; a victim file and a link to it planted
# at the name the script once wrote dockerd's log to; the script run, the victim copied out.
_OWN_TMP = r"""
mkdir new-tmp
mount -t tmpfs tmpfs new-tmp
case "$1" in /tmp/*) mkdir -p "new-tmp${1#/tmp}" && mount --bind "$1" "new-tmp${1#/tmp}" ;; esac
mount --move new-tmp /tmp
printf precious > /tmp/victim
ln -s /tmp/victim /tmp/sm121-dockerd.log
code=0
PATH="$2" /bin/bash "$1/system" > "$1/out" 2>&1 || code=$?
for _ in $(seq 200); do grep -q '^dockerd' "$1/calls" && break; sleep 0.05; done
cp /tmp/victim "$1/victim-after"
find /tmp -maxdepth 2 -path '/tmp/sm121-dockerd.*' ! -type l -printf '%p %m %y\n' > "$1/made"
exit "$code"
"""


def test_dockerds_log_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    """Root started dockerd with its log at the fixed /tmp/sm121-dockerd.log: a link planted
    there by anyone made root overwrite the file it points at.  The log now goes into a
    folder mktemp -d makes (0700), and the planted link's target is untouched."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("root and unshare are needed to give the script a /tmp of its own")
    env = _machine(tmp_path, {"docker.io", *EVERYTHING}, running=False, dockerd=True)
    shutil.copy2(SCRIPT, tmp_path / "system")
    command = [unshare, "--mount", "--propagation", "private", "/bin/bash", "-euc", _OWN_TMP,
               "own-tmp", str(tmp_path), env["PATH"]]
    code, _out, calls = _run({**env, "PATH": os.environ["PATH"]}, command, cwd=tmp_path)
    out = (tmp_path / "out").read_text() if (tmp_path / "out").exists() else _out
    assert code != 0 and any(c.startswith("dockerd") for c in calls), out  # it was started
    assert (tmp_path / "victim-after").read_text() == "precious", out
    made = (tmp_path / "made").read_text().split()
    assert len(made) == 6 and made[1:3] == ["700", "d"] and made[3].endswith("/dockerd.log")
    assert f"its log: {made[3]}" in out, out


def test_a_hung_engine_is_said_in_one_line(tmp_path: Path) -> None:
    """`docker info` against an engine that accepts and never answers: the deadline
    (SM121_CI_PROBE_TIMEOUT, 1 s here) ends it, and the script says so in one line."""
    env = _machine(tmp_path, {"docker-ce", *EVERYTHING}, running=False, dockerd=True)
    _stub(Path(env["PATH"]), "docker", "exec python3 -c 'import time; time.sleep(100)'\n")
    env["SM121_CI_PROBE_TIMEOUT"] = "1"
    code, out, calls = _run(env)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, out
    assert errors[0].startswith("error: `docker info` hung (no answer in 1 s)"), out
    assert not any(c.startswith(("dockerd", "apt-get")) for c in calls), calls


def test_an_engine_this_script_starts_may_hang_while_it_comes_up(tmp_path: Path) -> None:
    """The dockerd the script started answers nothing at first (it is starting): a hang then
    is only "not yet", and the wait goes on until it answers."""
    env = _machine(tmp_path, {"docker.io", *EVERYTHING}, running=False)
    env["SM121_CI_PROBE_TIMEOUT"] = "1"
    bin_dir = Path(env["PATH"])
    _stub(bin_dir, "dockerd", ': > "$CALLS.up"\n')
    _stub(bin_dir, "docker", '[ -e "$CALLS.up" ] || exit 1\n'
          'n=$(cat "$CALLS.n" 2>/dev/null || echo 0); echo $((n + 1)) > "$CALLS.n"\n'
          '[ "$n" -ge 2 ] || exec python3 -c "import time; time.sleep(100)"\n'
          'echo "engine 99.0"\n')
    code, out, calls = _run(env)
    assert code == 0 and "engine 99.0" in out and "error:" not in out, out
    # two hangs, the answer that ends the wait, then the engine line
    assert int((tmp_path / "calls.n").read_text()) == 4, calls


def test_a_socket_that_takes_no_connection_is_said_in_one_line(tmp_path: Path) -> None:
    """An engine's socket whose queue is full (it accepts nothing): a connect without a
    deadline waits for ever; the probe's deadline names it in one line."""
    import socket

    env = _machine(tmp_path, set(EVERYTHING), running=False, dockerd=True)
    env["SM121_CI_PROBE_TIMEOUT"] = "1"
    (tmp_path / "run").mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "run" / "docker.sock"))
    listener.listen(0)
    queued = socket.socket(socket.AF_UNIX)
    queued.connect(str(tmp_path / "run" / "docker.sock"))  # the one place in its queue
    try:
        code, out, calls = _run(env)
    finally:
        queued.close()
        listener.close()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 1 and errors == [f"error: the engine's socket {tmp_path}/run/docker.sock "
                                    "hung (no connection in 1 s): restart that engine (sudo "
                                    "systemctl restart docker), then run this again"], out
    assert not any(c.startswith(("dockerd", "apt-get")) for c in calls), calls


@pytest.mark.parametrize("value", ["0", "ten", "-1", "010", "1.5"])
def test_a_bad_probe_deadline_is_refused(tmp_path: Path, value: str) -> None:
    env = {**_machine(tmp_path, {"docker-ce", *EVERYTHING}, running=True),
           "SM121_CI_PROBE_TIMEOUT": value}
    code, out, calls = _run(env)
    assert code == 1 and out.startswith("error: SM121_CI_PROBE_TIMEOUT="), out
    assert calls == [], calls


@pytest.mark.parametrize("docs_fail", [False, True])
def test_ci_run_leaves_no_rendered_site_in_temp(tmp_path: Path, docs_fail: bool) -> None:
    """`.ci/run` on a copy of itself with every step stubbed (.ci/system, lint, the venv's
    python and pip, a CUDA 13.0 nvcc; the stub mkdocs writes its site where it is told):
    the site's temp folder is gone when the run ends, whether the docs build passed or
    failed (its exit code passed on)."""
    checkout = tmp_path / "co"
    (checkout / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", checkout / ".ci" / "run")
    for step in ("system", "lint"):
        (checkout / ".ci" / step).write_text("#!/bin/sh\nexit 0\n")
    bin_dir, temp, cuda = tmp_path / "bin", tmp_path / "tmp", tmp_path / "cuda" / "bin"
    for folder in (bin_dir, temp, cuda):
        folder.mkdir(parents=True)
    sites = tmp_path / "sites"
    mkdocs = ('#!/bin/bash\nwhile [ $# -gt 0 ]; do [ "$1" = --site-dir ] && { mkdir -p "$2"; '
              f'echo x > "$2/index.html"; echo "$2" >> {sites}; }}; shift; done\n'
              f'exit {1 if docs_fail else 0}\n')
    _stub(bin_dir, "python3", 'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"\n'
          f'printf "#!/bin/sh\\nexit 0\\n" > "$3/bin/python"\ncat > "$3/bin/mkdocs" <<\'EOM\'\n'
          f'{mkdocs}EOM\nchmod +x "$3/bin/python" "$3/bin/mkdocs"; fi\nexit 0\n')
    _stub(cuda, "nvcc", 'echo "Cuda compilation tools, release 13.0, V13.0.48"\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(temp),
           "CUDA_HOME": str(cuda.parent), "CALLS": str(tmp_path / "calls"),
           "HOME": str(tmp_path)}
    code, output, _calls = _run(env, ["/bin/bash", str(checkout / ".ci" / "run")])
    assert code == (1 if docs_fail else 0), output
    site = Path(sites.read_text().strip())
    assert site.is_relative_to(temp), site  # the stub was run, and wrote into TMPDIR
    assert list(temp.iterdir()) == [], output


def test_cuda_from_pypi_never_lays_out_the_folder_a_target_link_names(tmp_path: Path) -> None:
    """Red team 3: a TARGET that was a link had the folder it names removed and made anew."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep").write_text("mine")
    (tmp_path / "link").symlink_to(real)
    done = subprocess.run(["bash", str(ROOT / ".ci" / "cuda-from-pypi"), sys.executable,
                           str(tmp_path / "link")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 1 and "a link" in done.stderr and done.stdout == ""
    assert (real / "keep").read_text() == "mine"
