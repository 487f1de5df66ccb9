"""`sm121-build doctor`: every check's OK / WARN / FAIL and its fix, on this machine through
the CLI (an engine that is not there), and on FAKE machines through `Probe`: no disk, no
BuildKit, no GPU, a DGX Spark's nvidia-smi (its output recorded), logins in a docker
config, an unwritable state folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.helpers import ROOT, cli, cli_as_nobody
from sm121_build.jobs.upkeep.doctor_checks import (
    GB,
    Check,
    EngineFacts,
    Probe,
    buildkit,
    disk,
    docker_group,
    gpu,
    paths,
    registry_logins,
    run_checks,
    worst,
)

ENGINE = EngineFacts("28.5.1", "1.51", "aarch64", "/var/lib/docker", "unix:///run/docker.sock")
# nvidia-smi on a DGX Spark (GB10): the query row, and the banner's CUDA version line
SPARK_ROW = "NVIDIA GB10, 12.1, 580.95.05\n"
SPARK_BANNER = ("| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      "
                "CUDA Version: 13.0     |\n")


def fake_probe(*, engine: EngineFacts | None = ENGINE, free: int = 500 * GB,
               tools: tuple[str, ...] = ("docker", "cmake", "ninja", "nvcc", "ptxas"),
               smi: tuple[str, str] | None = None, buildkit_help: str = "--secret",
               environ: dict[str, str] | None = None) -> Probe:
    """A FAKE machine (the boundary: engine, disks, PATH, nvidia-smi)."""

    def engine_facts() -> EngineFacts:
        if engine is None:
            raise ConnectionRefusedError("FAKE: no engine")
        return engine

    def which(name: str) -> str | None:
        if name == "nvidia-smi":
            return "/usr/bin/nvidia-smi" if smi else None
        return f"/usr/bin/{name}" if name in tools else None

    def run(args: list[str]) -> str | None:
        if args[0].endswith("nvidia-smi"):
            assert smi is not None
            return smi[0] if len(args) > 1 else smi[1]
        if args[1:] == ["build", "--help"]:
            return f"Usage: docker build ... {buildkit_help}"
        return None

    return Probe(engine=engine_facts, free=lambda _path: free, which=which, run=run,
                 environ=environ if environ is not None else {"HOME": "/nonexistent"})


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_ready_spark_is_all_ok() -> None:
    checks = by_name(run_checks(fake_probe(smi=(SPARK_ROW, SPARK_BANNER))))
    assert checks["engine"].detail == ("Docker 28.5.1 (API 1.51), aarch64, at "
                                       "unix:///run/docker.sock")
    assert checks["gpu"] == Check("gpu", "OK", "NVIDIA GB10, compute capability 12.1, driver "
                                  "580.95.05 (CUDA 13.0): a DGX Spark GPU")
    assert "platform" not in checks  # arm64: builds natively
    assert checks["buildkit"].status == "OK"
    assert {c.status for n, c in checks.items() if n not in ("cache", "state")} == {"OK"}


def test_the_engine_down_fails_with_the_fix() -> None:
    checks = by_name(run_checks(fake_probe(engine=None)))
    engine = checks["engine"]
    assert engine.status == "FAIL" and "ConnectionRefusedError" in engine.detail
    assert "systemctl start docker" in engine.fix
    assert checks["engine disk"].status == "WARN"  # unknown, not guessed
    assert worst(list(checks.values())) == "FAIL"


@pytest.mark.parametrize(("free", "base", "status"), [
    (31 * GB, None, "OK"), (29 * GB, None, "WARN"), (9 * GB, None, "FAIL"),
    (11 * GB, 20 * GB, "OK"),  # the base is here already: only the build's room
])
def test_engine_disk_against_what_a_run_needs(free: int, base: int | None,
                                              status: str) -> None:
    check = disk(fake_probe(free=free), ENGINE, base)[0]
    assert check.name == "engine disk" and check.status == status
    assert check.detail.startswith(f"{free / GB:.1f} GB free at /var/lib/docker")
    assert (check.fix == "") == (status == "OK")


def test_no_disk_in_temp_fails() -> None:
    temp = disk(fake_probe(free=GB // 10), ENGINE, None)[1]
    assert temp.name == "temp disk" and temp.status == "FAIL" and "TMPDIR" in temp.fix


def test_an_engine_whose_storage_is_not_visible_here() -> None:
    def remote(path: str) -> int:
        raise FileNotFoundError(path)

    probe = fake_probe()
    probe.free = remote
    check = disk(probe, ENGINE, None)[0]
    assert check.status == "WARN" and "remote engine" in check.detail


def test_no_buildkit_warns() -> None:
    assert buildkit(fake_probe(tools=()))[0].status == "WARN"
    assert buildkit(fake_probe(buildkit_help="(no secrets)"))[0].status == "WARN"
    assert buildkit(fake_probe())[0].status == "OK"


@pytest.mark.parametrize(("smi", "status", "target", "driver"), [
    (None, "WARN", None, None),
    ((SPARK_ROW, SPARK_BANNER), "OK", "sm_121", "13.0"),
    (("NVIDIA H100 80GB HBM3, 9.0, 570.86.15\n", "CUDA Version: 12.8 |"), "WARN", "sm_90",
     "12.8"),
    (("", ""), "WARN", None, None),
])
def test_the_gpu_and_driver(smi: tuple[str, str] | None, status: str, target: str | None,
                            driver: str | None) -> None:
    checks, found_target, found_driver = gpu(fake_probe(smi=smi))
    assert checks[0].status == status
    assert (found_target, found_driver) == (target, driver)


def test_registry_logins_from_the_docker_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "auths": {"https://index.docker.io/v1/": {}, "ghcr.io": {}},
        "credHelpers": {"123.dkr.ecr.us-east-1.amazonaws.com": "ecr-login"}}))
    probe = fake_probe(environ={"DOCKER_CONFIG": str(tmp_path)})
    checks = by_name(registry_logins(probe, ["vllm/vllm-openai:nightly", "ghcr.io/me/k:1",
                                             "123.dkr.ecr.us-east-1.amazonaws.com/x",
                                             "127.0.0.1:5000/kernels"]))
    assert [c.status for c in checks.values()] == ["OK", "OK", "OK", "WARN"]
    assert checks["login 127.0.0.1:5000"].fix == "docker login 127.0.0.1:5000"
    store = fake_probe(environ={"DOCKER_CONFIG": str(tmp_path / "other")})
    assert registry_logins(store, ["ghcr.io/x"])[0].fix == "docker login ghcr.io"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"credsStore": "pass"}')
    assert registry_logins(store, ["ghcr.io/x"])[0].status == "OK"


def test_as_a_user_without_the_socket_or_the_state_folder() -> None:
    """Run as an unprivileged user (setpriv, as root; as is otherwise): an engine socket it
    may not use fails with the docker-group fix, an unwritable state folder fails."""
    folder = Path(f"/tmp/sm121-doctor-{os.getpid()}")
    folder.mkdir(mode=0o755)
    try:
        socket = folder / "docker.sock"
        socket.write_text("")
        socket.chmod(0o600)
        locked = folder / "state"
        locked.mkdir(mode=0o500)
        env = {**os.environ, "DOCKER_HOST": f"unix://{socket}", "XDG_STATE_HOME": str(locked),
               "XDG_CACHE_HOME": str(folder / "cache"), "HOME": "/nonexistent"}
        if os.geteuid() == 0:
            done = cli_as_nobody("doctor", "--json", env=env)
        elif os.access(socket, os.W_OK):
            pytest.skip("this user owns the files it makes: nothing to refuse")
        else:
            done = subprocess.run([sys.executable, "-m", "sm121_build", "doctor", "--json"],
                                  capture_output=True, text=True, check=False, cwd=ROOT,
                                  env=env)
        checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
        assert done.returncode == 2
        assert checks["engine"]["status"] == "FAIL"
        assert checks["engine"]["detail"] == f"{socket} is there but this user may not use it"
        assert "usermod -aG docker" in checks["engine"]["fix"]
        assert checks["state"]["status"] == "FAIL" and "XDG_STATE_HOME" in checks["state"]["fix"]
        assert checks["docker group"]["status"] == "WARN"
    finally:
        shutil.rmtree(folder)


def test_a_user_who_cannot_start_this_checkout_is_a_skip_saying_why(tmp_path: Path) -> None:
    """uid 65534 shut out of the interpreter (a venv under a 0700 home: `sudo bash .ci/run`
    from /root) failed the test above with a bare JSONDecodeError (issue #62): now a skip,
    one line naming the interpreter and why."""
    if os.geteuid() != 0:
        pytest.skip("only root can run a command as another user")
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    (private / "python").symlink_to(sys.executable)
    with pytest.raises(pytest.skip.Exception) as skipped:
        cli_as_nobody("doctor", "--json", env=dict(os.environ), python=str(private / "python"))
    said = str(skipped.value)
    # what stopped it, as that user met it (exec refused, the venv's files unread), in ()
    assert re.fullmatch(rf"uid 65534 cannot start {re.escape(str(private / 'python'))} -m "
                        rf"sm121_build in {re.escape(str(ROOT))} \(.+\): a 0700 folder above "
                        r"the venv or the checkout\? Put them where that user may read",
                        said), said


def test_paths_name_the_cache_and_state_folders(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "s"))
    (tmp_path / "s" / "sm121-build").mkdir(parents=True)
    (tmp_path / "s" / "sm121-build" / "ledger.json").write_bytes(b"x" * 2000)
    checks = by_name(paths())
    assert checks["cache"].detail.startswith(f"{tmp_path / 'c' / 'sm121-build'} (0.0 GB;")
    assert checks["state"].status == "OK" and "ledger" in checks["state"].detail


def _doctor(*args: str, **env: str) -> tuple[int, dict[str, object]]:
    done = cli("doctor", "--json", *args, env=env)
    return done.returncode, json.loads(done.stdout)


def test_the_cli_with_the_engine_down_exits_2_and_says_the_fix(tmp_path: Path) -> None:
    code, data = _doctor(DOCKER_HOST=f"unix://{tmp_path}/none.sock")
    checks = data["checks"]
    assert isinstance(checks, list)
    engine = checks[0]
    assert code == 2 and data["worst"] == "FAIL"
    assert engine["name"] == "engine" and engine["status"] == "FAIL"
    assert "DOCKER_HOST" in engine["fix"]
    text = cli("doctor", env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"})
    assert text.returncode == 2 and text.stdout.splitlines()[0].startswith("FAIL engine")
    assert text.stdout.splitlines()[-1] == "worst: FAIL"
    if os.geteuid() == 0:  # root is told OK only where a socket is (issue #62)
        group = next(c for c in checks if isinstance(c, dict) and c["name"] == "docker group")
        assert group["status"] == "WARN" and "no socket at" in group["detail"], group


def test_root_is_told_the_socket_is_usable_only_where_there_is_one(tmp_path: Path) -> None:
    """As root with no socket, doctor said "docker group OK: root: the engine's socket is
    usable" beside its own engine FAIL (issue #62): OK now only once a socket is there."""
    import socket

    def as_root(host: str) -> Check:
        probe = fake_probe(environ={"DOCKER_HOST": host})
        probe.euid = lambda: 0
        (check,) = docker_group(probe)
        return check

    none = as_root(f"unix://{tmp_path}/docker.sock")
    assert none.status == "WARN" and none.detail.startswith(
        f"root, but no socket at {tmp_path}/docker.sock")
    assert "systemctl start docker" in none.fix
    (tmp_path / "file.sock").write_text("")  # a file, not a socket
    assert as_root(f"unix://{tmp_path}/file.sock").status == "WARN"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "docker.sock"))
    try:
        there = as_root(f"unix://{tmp_path}/docker.sock")
    finally:
        listener.close()
    assert there == Check("docker group", "OK",
                          f"root may use the engine's socket {tmp_path}/docker.sock")
    remote = as_root("tcp://10.0.0.5:2376")
    assert remote.status == "OK" and "not a socket on this machine" in remote.detail


def test_a_bad_registry_reference_is_refused_before_any_check() -> None:
    done = cli("doctor", "--registry", "Not A Ref")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: ")


def test_tools_are_found_where_the_set_up_put_them(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """cmake and ninja in the tool's own venv (not on PATH until it is activated), ptxas of
    `[cuda]` (PyPI's nvidia folder): found, not called missing (issue #55)."""
    from sm121_build.jobs.upkeep import doctor_checks as doctor_module

    venv, nvidia = tmp_path / "venv" / "bin", tmp_path / "nvidia" / "cu13" / "bin"
    for folder, tools in ((venv, ("python", "cmake", "ninja")), (nvidia, ("ptxas", "nvcc"))):
        folder.mkdir(parents=True)
        for tool in tools:
            (folder / tool).write_text("#!/bin/sh\n")
            (folder / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(doctor_module.sys, "executable", str(venv / "python"))
    monkeypatch.setattr(doctor_module, "ptxas_folders", lambda: [nvidia])
    monkeypatch.setattr(doctor_module.Path, "glob", lambda self, pattern: iter(()))
    assert doctor_module.find_tool("cmake") == str(venv / "cmake")
    assert doctor_module.find_tool("ptxas") == str(nvidia / "ptxas")
    assert doctor_module.find_tool("nvcc") == str(nvidia / "nvcc")
    assert doctor_module.find_tool("no-such-tool") is None


def test_a_time_limit_every_command_would_refuse_is_a_fail() -> None:
    """SM121_ENGINE_TIMEOUT=nan: `prune` and `pin` refuse it before any work; doctor says so
    instead of calling the engine OK (red team, issue #54)."""
    from sm121_build.jobs.upkeep.doctor_checks import limits

    def probe(**environ: str) -> Probe:
        return Probe(engine=lambda: EngineFacts("28", "1.47", "x86_64", "/", "unix://"),
                     environ=dict(environ))

    (bad,) = limits(probe(SM121_ENGINE_TIMEOUT="nan"))
    assert bad.status == "FAIL" and "SM121_ENGINE_TIMEOUT='nan'" in bad.detail
    (good,) = limits(probe(SM121_REGISTRY_TIMEOUT="5"))
    assert good.status == "OK" and "registry 5 s" in good.detail


def test_a_docker_cli_without_buildkit_is_named_not_called_missing() -> None:
    """A docker CLI that is there but whose `build --help` fails, hangs or lacks BuildKit is
    named as such; "no docker CLI" only when there is none."""
    from sm121_build.jobs.upkeep.doctor_checks import buildkit

    there = buildkit(fake_probe(buildkit_help="(classic builder only)"))[0]
    assert there.status == "WARN" and there.detail.startswith(
        "/usr/bin/docker: `build --help` failed, hung or offers no BuildKit")
    none = buildkit(fake_probe(tools=("cmake",)))[0]
    assert none.status == "WARN" and none.detail.startswith("no docker CLI with BuildKit")


@pytest.mark.parametrize("shape", ["[1,2]", '"x"', "1", "null", '{"auths": [1]}',
                                   '{"auths": null, "credHelpers": "x", "credsStore": 1}'])
def test_a_docker_config_of_another_shape_is_no_login(tmp_path: Path, shape: str) -> None:
    """config.json that is valid JSON but not an object (or whose parts are of another
    type) is read as no login: a WARN line, never an AttributeError."""
    (tmp_path / "config.json").write_text(shape)
    probe = fake_probe(environ={"DOCKER_CONFIG": str(tmp_path)})
    checks = registry_logins(probe, ["ghcr.io/x/y"])
    assert [(c.status, c.fix) for c in checks] == [("WARN", "docker login ghcr.io")]


def _hostile_config(tmp_path: Path, kind: str) -> Path:
    """A DOCKER_CONFIG folder whose config.json is a FIFO or a link to /dev/zero."""
    folder = tmp_path / kind
    folder.mkdir()
    if kind == "fifo":
        os.mkfifo(folder / "config.json")
    else:
        (folder / "config.json").symlink_to("/dev/zero")
    return folder


def _bounded(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The CLI with at most 1 GiB of address space, ended (a failure) if it hangs."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    try:
        return subprocess.run([sys.executable, "-m", "sm121_build", *args],
                              capture_output=True, text=True, check=False, timeout=60,
                              env={**os.environ, **env}, preexec_fn=cap)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args} hung on a hostile Docker config.json")


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_docker_config_that_blocks_or_floods_is_one_line_before_the_sdk(
        tmp_path: Path, kind: str) -> None:
    """The Docker SDK (and the docker CLI) read config.json themselves with a blocking,
    unbounded read: a FIFO or /dev/zero there is refused through the files-in door before
    either is asked: a command that reaches the engine ends at once in one line (exit 4),
    and doctor says it as FAIL lines with the fix."""
    env = {"DOCKER_CONFIG": str(_hostile_config(tmp_path, kind)),
           "DOCKER_HOST": f"unix://{tmp_path}/none.sock", "XDG_STATE_HOME": str(tmp_path)}
    said = "a FIFO" if kind == "fifo" else "a character device"
    done = _bounded("prune", "--keep", "1", env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 4 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and said in lines[0] and "DOCKER_CONFIG" in lines[0]
    doctor = _bounded("doctor", "--json", env=env)
    assert "Traceback" not in doctor.stderr, doctor.stderr
    checks = by_name([Check(**c) for c in json.loads(doctor.stdout)["checks"]])
    for name in ("engine", "buildkit"):
        assert checks[name].status == "FAIL" and said in checks[name].detail, checks[name]
        assert "DOCKER_CONFIG" in checks[name].fix


@pytest.mark.parametrize("shape", [
    "[1,2]", "null", '{"proxies": [1]}', '{"proxies": {"default": [1]}}', '{"auths": [1]}',
    '{"auths": {"x": 1}}', '{"auths": {"x": {"auth": 1}}}', '{"HttpHeaders": [1]}',
    '{"HttpHeaders": {"X": 1}}', "not json", '{"auths": {"x": {"auth": "dTpw"}}}',
    '{"proxies": {"default": {"httpProxy": "http://p:3128"}}, "HttpHeaders": {"X": "y"}}',
    # red team 5: an `auth` the SDK's own decoding fails on (not base64, no colon, not ASCII),
    # in `auths` or in the old auth-only shape, and a credential store or helpers of
    # another type (the SDK runs `docker-credential-` + it)
    '{"auths": {"x": {"auth": "!!not base64"}}}', '{"auths": {"x": {"auth": "bm9jb2xvbg=="}}}',
    '{"auths": {"x": {"auth": "\u00e9"}}}', '{"x": {"auth": "!!not base64"}}',
    '{"credsStore": 5}', '{"credHelpers": {"x": 5}}', '{"credHelpers": [1]}'])
def test_what_the_config_check_lets_through_the_sdk_can_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    """Every config.json shape is either refused in one line (DockerConfigRefused) or one
    the SDK's client is made from, and asks the engine with, without an error of its own
    (here only the missing socket's)."""
    import docker
    import requests

    from sm121_build.core.errors import DockerConfigRefused
    from sm121_build.image.engine import check_docker_config

    (tmp_path / "config.json").write_text(shape)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    try:
        check_docker_config()
    except DockerConfigRefused as exc:
        assert str(tmp_path / "config.json") in str(exc)
        return
    client = docker.from_env(version="1.41", timeout=1)
    with pytest.raises(requests.exceptions.ConnectionError):  # no socket: only that
        client.ping()
    store = client.api._auth_configs.get_credential_store("x")  # a pull's, push's, build's
    assert store is None or isinstance(store, str)  # (the SDK prefixes it: a program's name)
    client.close()
