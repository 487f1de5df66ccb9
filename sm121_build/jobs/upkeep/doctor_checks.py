"""`sm121-build doctor`: what this machine has for a run, each line OK / WARN / FAIL with
the fix, so a user meets every problem at once instead of one failure per run.

Each check is a small function returning `Check`s; what it asks the system (the engine,
`nvidia-smi`, free disk, the docker CLI) comes through `Probe`, so the tests can stand in
for a machine without a disk or a GPU (named FAKE there) and the real probe runs everywhere
else.  Nothing here changes anything.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sm121_build.core.errors import DockerConfigRefused, Sm121Error
from sm121_build.core.inputs import read_input
from sm121_build.core.limits import Limits
from sm121_build.core.paths import cache_dir, state_dir
from sm121_build.cuda.compat import DEFAULT_DRIVER_CUDA, DEFAULT_GPU, is_default_gpu
from sm121_build.cuda.nvidia_smi import output, read
from sm121_build.cuda.ptxas import INSTALL_HINT, Toolchain, ptxas_folders, toolchains
from sm121_build.image.build_tools import host_tools
from sm121_build.image.refs import registry_of

Status = Literal["OK", "WARN", "FAIL"]
RANK: dict[Status, int] = {"OK": 0, "WARN": 1, "FAIL": 2}  # also the exit code of the worst

GB = 1000**3
# A run pulls the base (~20 GB for today's vLLM images) and builds beside it: the builder
# stage's tree and objects (~10 GB for _C + FA2) and the result's new layer (~0.6 GB).
BASE_BYTES = 20 * GB
BUILD_BYTES = 10 * GB
# Temp holds the device-code files an audit or verification reads from an image (0.6-1 GB
# measured on a 19.5 GB image, docs/measurements.md).
TEMP_BYTES = 2 * GB
DOCKER_HUB = "https://index.docker.io/v1/"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "fix": self.fix}


@dataclass(frozen=True)
class EngineFacts:
    version: str
    api: str
    arch: str
    root: str  # DockerRootDir: where images are stored
    host: str


@dataclass
class Probe:
    """What the checks ask this machine."""

    engine: Callable[[], EngineFacts]  # raises OSError/Exception naming why not
    free: Callable[[str], int] = field(default=lambda path: shutil.disk_usage(path).free)
    which: Callable[[str], str | None] = field(default=lambda name: find_tool(name))
    run: Callable[[list[str]], str | None] = field(default=lambda args: output(args))
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    toolchains: Callable[[], list[Toolchain]] = field(default=lambda: toolchains(None))
    euid: Callable[[], int] = field(default=lambda: os.geteuid())


def find_tool(name: str) -> str | None:
    """Where a tool is, wherever this tool's set-up put it: PATH; this Python's own
    environment (cmake and ninja come with the package, in its venv, reached by name only
    once that is on PATH); the folders aot looks in for ptxas ($CUDA_HOME, PyPI's
    nvidia-cuda-nvcc of `[cuda]`, /usr/local/cuda); and every /usr/local/cuda*."""
    found = shutil.which(name)
    if found:
        return found
    folders = [Path(sys.executable).parent, *ptxas_folders(),
               *sorted(Path("/usr/local").glob("cuda*/bin"), reverse=True)]
    for folder in folders:
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def docker_engine() -> EngineFacts:
    """The real engine's facts (the engine module, and the Docker SDK, imported only here)."""
    from sm121_build.image.engine import version_and_info

    version, info = version_and_info()
    return EngineFacts(str(version.get("Version", "?")), str(version.get("ApiVersion", "?")),
                       str(info.get("Architecture", "?")), str(info.get("DockerRootDir", "")),
                       os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))


def _gb(size: int) -> str:
    return f"{size / GB:.1f} GB"


def engine_checks(probe: Probe) -> tuple[list[Check], EngineFacts | None]:
    host = probe.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        facts = probe.engine()
    except DockerConfigRefused as exc:
        return [Check("engine", "FAIL", exc.detail,
                      f"Docker's config.json: {exc.fix}")], None
    except Exception as exc:
        socket = host.removeprefix("unix://") if host.startswith("unix://") else ""
        if socket and os.path.exists(socket) and not os.access(socket, os.R_OK | os.W_OK):
            return [Check("engine", "FAIL", f"{socket} is there but this user may not use it",
                          "add yourself to the docker group (`sudo usermod -aG docker "
                          "$USER`, then log in again), or run as root")], None
        return [Check("engine", "FAIL", f"cannot reach the Docker engine at {host} "
                      f"({type(exc).__name__})",
                      "start it (`sudo systemctl start docker`, or `dockerd &`) or set "
                      "DOCKER_HOST")], None
    checks = [Check("engine", "OK", f"Docker {facts.version} (API {facts.api}), "
                    f"{facts.arch}, at {facts.host}")]
    if facts.arch not in ("aarch64", "arm64"):
        checks.append(Check("platform", "WARN", f"the engine runs {facts.arch}: a DGX Spark "
                            "image (arm64) is read and audited here, but built only under "
                            "emulation (hours)", "build on the Spark itself, or an arm64 "
                            "runner"))
    return checks, facts


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def docker_group(probe: Probe) -> list[Check]:
    """May this user use the engine's local socket?  Root may use any socket there is, and
    is told OK only once one is there; another user through the docker group.  An engine
    reached another way (tcp://, ssh://) asks for no group."""
    host = probe.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return [Check("docker group", "OK", f"the engine is at {host}, not a socket on this "
                      "machine: no group is needed")]
    socket = host.removeprefix("unix://")
    if probe.euid() == 0:
        if _is_socket(socket):
            return [Check("docker group", "OK", f"root may use the engine's socket {socket}")]
        return [Check("docker group", "WARN", f"root, but no socket at {socket}: nothing to "
                      "use (the engine line says why)", "start the engine (`sudo systemctl "
                      "start docker`, or `dockerd &`) or set DOCKER_HOST")]
    try:
        members = grp.getgrnam("docker")
    except KeyError:
        return [Check("docker group", "WARN", "no docker group on this machine",
                      "use rootless Docker, or create the group (`sudo groupadd docker`) "
                      "and join it")]
    user = probe.environ.get("USER", "")
    if members.gr_gid in os.getgroups() or user in members.gr_mem:
        return [Check("docker group", "OK", f"{user or 'this user'} is in the docker group")]
    return [Check("docker group", "WARN", f"{user or 'this user'} is not in the docker group",
                  "`sudo usermod -aG docker $USER`, then log in again")]


def buildkit(probe: Probe) -> list[Check]:
    from sm121_build.image.engine import find_buildkit_client

    try:
        path = find_buildkit_client(probe.which, lambda client: probe.run([client, "build",
                                                                           "--help"]))
    except DockerConfigRefused as exc:
        return [Check("buildkit", "FAIL", f"the docker CLI was not asked: it reads Docker's "
                      f"config.json too ({exc.detail})", f"Docker's config.json: {exc.fix}")]
    if path:
        return [Check("buildkit", "OK", f"{path} builds with BuildKit (cache mounts: a "
                      "rebuild reuses ccache)")]
    from sm121_build.image.engine import BUILDKIT_CLIENT_CANDIDATES

    clients = list(dict.fromkeys(f for f in map(probe.which, BUILDKIT_CLIENT_CANDIDATES) if f))
    what = (f"{', '.join(clients)}: `build --help` failed, hung or offers no BuildKit"
            if clients else "no docker CLI with BuildKit")
    return [Check("buildkit", "WARN", f"{what}: builds go through the "
                  "engine's classic builder (no cache mounts, every rebuild compiles from "
                  "scratch)", "install the docker CLI (Debian/Ubuntu: `apt-get install "
                  "docker.io` or docker-ce-cli with docker-buildx-plugin)")]


def disk(probe: Probe, engine: EngineFacts | None, base_bytes: int | None) -> list[Check]:
    checks = []
    need = (BASE_BYTES if base_bytes is None else 0) + BUILD_BYTES
    said = "a ~20 GB base pull and a build" if base_bytes is None else "a build beside the " \
        "base, which is already here"
    if engine is None or not engine.root:
        checks.append(Check("engine disk", "WARN", "the engine's storage is unknown (engine "
                            "not reached)", "run doctor again once the engine is up"))
    else:
        try:
            free = probe.free(engine.root)
        except OSError:
            checks.append(Check("engine disk", "WARN", f"cannot see {engine.root} from here "
                                "(a remote engine, or another mount namespace)",
                                f"check free space on the engine's host: {need / GB:.0f} GB "
                                f"for {said}"))
        else:
            status: Status = "OK" if free >= need else "FAIL" if free < BUILD_BYTES else "WARN"
            checks.append(Check("engine disk", status, f"{_gb(free)} free at {engine.root}; "
                                f"{need / GB:.0f} GB for {said}",
                                "" if status == "OK" else "free space (`docker system df`, "
                                "`sm121-build prune`, `docker image prune`) or move "
                                "Docker's data-root"))
    temp = tempfile.gettempdir()
    try:
        free = probe.free(temp)
    except OSError as exc:
        return [*checks, Check("temp disk", "FAIL", f"{temp}: {exc.strerror or exc}",
                               "set TMPDIR to a writable folder")]
    status = "OK" if free >= TEMP_BYTES else "FAIL" if free < TEMP_BYTES // 4 else "WARN"
    checks.append(Check("temp disk", status, f"{_gb(free)} free in {temp} (TMPDIR); about "
                        f"{TEMP_BYTES / GB:.0f} GB for reading an image's device code",
                        "" if status == "OK" else "set TMPDIR to a folder with more room"))
    return checks


def host_tools_checks(probe: Probe) -> list[Check]:
    """This machine's compilers: `sm121-build local` uses them all, `aot` (and the main
    job's aot actions) ptxas and fatbinary; a source build compiles inside the image."""
    found = {tool: probe.which(tool) for tool in ("cmake", "ninja", "nvcc", "ptxas")}
    missing = [tool for tool, path in found.items() if not path]
    have = ", ".join(f"{tool} {path}" for tool, path in found.items() if path) or "none"
    if not missing:
        return [Check("host tools", "OK", f"{have} (for sm121-build local; ptxas for aot)")]
    if host_tools() is not None and set(missing) <= {"cmake", "ninja"}:
        return [Check("host tools", "OK", f"{have}; cmake/ninja from this Python "
                      "environment (for sm121-build local)")]
    return [Check("host tools", "WARN", f"no {', '.join(missing)} here: `sm121-build local` "
                  "needs them, aot needs ptxas (a source build compiles inside the image)",
                  f"install the CUDA toolkit (nvcc, ptxas), or `{INSTALL_HINT}` for aot's "
                  "ptxas")]


def aot_ptxas(probe: Probe) -> list[Check]:
    """The ptxas aot will use (the newest found, `cuda/ptxas.find_toolchain`) and the newest
    PTX ISA it reads: an image whose PTX is newer needs a newer one."""
    found = probe.toolchains()
    if not found:
        return [Check("aot ptxas", "WARN", "no ptxas with fatbinary beside it ($CUDA_HOME, "
                      "PATH, PyPI's nvidia-cuda-nvcc, /usr/local/cuda): aot cannot run",
                      f"`{INSTALL_HINT}`")]
    chosen = max(found, key=lambda t: t.release_key)
    isa = chosen.newest_isa
    reads = f"reads PTX ISA up to {isa[0]}.{isa[1]}" if isa < (99, 0) else \
        "newer than every CUDA release this tool knows: reads every PTX ISA it knows"
    others = [t.version for t in found if t is not chosen]
    beside = f"; also found: {', '.join(others)}" if others else ""
    return [Check("aot ptxas", "OK", f"{chosen}, {reads} (the newest found{beside})")]


def gpu(probe: Probe) -> tuple[list[Check], str | None, str | None]:
    """The GPU and driver from nvidia-smi: (checks, target like sm_121, driver CUDA X.Y)."""
    smi = probe.which("nvidia-smi")
    if not smi:
        return [Check("gpu", "WARN", "no nvidia-smi: this machine's GPU and driver are "
                      f"unknown; audit judges for {DEFAULT_GPU} under a CUDA "
                      f"{DEFAULT_DRIVER_CUDA} driver unless told",
                      "run on the Spark, or give `audit --target/--driver`")], None, None
    found = read(smi, probe.run)
    if found is None:
        return [Check("gpu", "WARN", "nvidia-smi found no GPU (or failed)",
                      "check the NVIDIA driver (`nvidia-smi`)")], None, None
    target, cuda = found.target, found.cuda
    detail = f"{found.name}, compute capability {found.capability}, driver {found.driver}" + \
        (f" (CUDA {cuda})" if cuda else "")
    if target is not None and is_default_gpu(target):
        return [Check("gpu", "OK", detail + ": a DGX Spark GPU")], target, cuda
    judged = f"audit judges for {target} here" if target else \
        f"its compute capability is unreadable: audit judges for {DEFAULT_GPU}"
    return [Check("gpu", "WARN", f"{detail}: not {DEFAULT_GPU}; {judged} unless --target "
                                 f"{DEFAULT_GPU} is "
                  "given", f"audit --target {DEFAULT_GPU} for a Spark")], target, cuda


def registry_logins(probe: Probe, refs: Iterable[str]) -> list[Check]:
    config_dir = Path(probe.environ.get("DOCKER_CONFIG") or
                      Path(probe.environ.get("HOME", "/")) / ".docker")
    try:
        found: object = json.loads(read_input(config_dir / "config.json", 1 << 20,
                                              "Docker's config.json"))
    except (OSError, ValueError, RecursionError, Sm121Error):
        found = {}
    # valid JSON of any shape: each level is type-checked, another shape is no login
    config: dict[str, Any] = found if isinstance(found, dict) else {}
    auths = _object(config.get("auths"))
    helpers = _object(config.get("credHelpers"))
    store = config.get("credsStore") if isinstance(config.get("credsStore"), str) else None
    checks = []
    for ref in refs:
        registry = registry_of(ref)
        key = DOCKER_HUB if registry == "docker.io" else registry
        if key in auths or registry in auths or registry in helpers:
            checks.append(Check(f"login {registry}", "OK", f"credentials for {registry} in "
                                f"{config_dir / 'config.json'}"))
        elif store:
            checks.append(Check(f"login {registry}", "OK", f"the credential store "
                                f"docker-credential-{store} answers for {registry}"))
        else:
            checks.append(Check(f"login {registry}", "WARN", f"no login for {registry} (a "
                                "public pull works; a push or a private pull does not)",
                                "docker login" + ("" if registry == "docker.io" else
                                                  f" {registry}")))
    return checks


def _object(value: object) -> dict[str, Any]:
    """`value` when it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def paths() -> list[Check]:
    checks = []
    for name, folder, what in (("cache", cache_dir(), "recomputable: image facts, sources"),
                               ("state", state_dir(), "the ledger of built images, logs")):
        fix = f"make {folder} writable, or set XDG_{name.upper()}_HOME"
        try:
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) \
                if folder.is_dir() else 0
            usable = os.access(folder if folder.exists() else _existing_parent(folder),
                               os.W_OK | os.X_OK)
        except OSError as exc:
            checks.append(Check(name, "FAIL", f"{folder}: {exc.strerror or exc}", fix))
            continue
        checks.append(Check(name, "OK" if usable else "FAIL",
                            f"{folder} ({_gb(size)}; {what})" if usable else
                            f"{folder}: this user cannot write there", "" if usable else fix))
    return checks


def _existing_parent(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def limits(probe: Probe) -> list[Check]:
    """The SM121_*_TIMEOUT variables, checked by the one rule every command applies before
    any work: a value it would refuse is a FAIL here, not an OK that the run then refuses."""
    try:
        found = Limits.from_environment(probe.environ)
    except Sm121Error as exc:
        return [Check("time limits", "FAIL", str(exc), "set it to a number of seconds, or "
                      "unset it for the default")]
    return [Check("time limits", "OK", f"engine {found.engine_s:g} s, registry "
                  f"{found.registry_s:g} s, CMake {found.cmake_s:g} s")]


def run_checks(probe: Probe, refs: tuple[str, ...] = (),
               base_bytes: int | None = None) -> list[Check]:
    checks, engine = engine_checks(probe)
    checks += limits(probe)
    checks += docker_group(probe)
    checks += buildkit(probe)
    checks += disk(probe, engine, base_bytes)
    checks += host_tools_checks(probe)
    checks += aot_ptxas(probe)
    checks += gpu(probe)[0]
    checks += registry_logins(probe, refs)
    checks += paths()
    return checks


def worst(checks: list[Check]) -> Status:
    return max((c.status for c in checks), key=RANK.__getitem__, default="OK")
