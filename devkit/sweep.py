"""A hostile sweep (README "Security"): variants of what an attacker hands the tool, each run
as a user would (the CLI in a fresh process) against the real engine and a real registry on
loopback, judged by outcome: refused in one `error:` line (exit >= 2) or handled (a program the tree
runs finds nothing to run in the container: exit 0), nothing written outside, nothing
hanging.  `python -m devkit.sweep` prints one line per case and the totals.

The cases: source trees whose CMake writes or runs on the host, loops, or reaches the
network (x patch, patch --explain, audit --source); trees with links leading out (cmake/,
cmake/external_projects/, CMakeLists.txt, a loop of links); a registry and an engine socket
that never answer; kernels images unsigned, re-signed and re-pointed (inject --from
--trust-key); limits that are not seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from devkit.helpers import DATA, compile_cached, gencode
from devkit.keys import key_pair, push_small
from devkit.registry import local_registry
from devkit.silent import silent_listener

LIMIT_S = 120


@dataclass(frozen=True)
class Outcome:
    case: str
    ok: bool
    how: str
    seconds: float


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                          text=True, check=False, timeout=LIMIT_S, env={**os.environ, **env})


def _refused(result: subprocess.CompletedProcess[str]) -> tuple[bool, str]:
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    ok = result.returncode >= 2 and len(errors) == 1 and "Traceback" not in result.stderr
    return ok, f"exit {result.returncode}: {(errors or ['(no error line)'])[0][:110]}"


def _tree(work: Path, name: str, prologue: str = "") -> Path:
    source = Path(shutil.copytree(DATA / "vllm_like", work / name / "src"))
    utils = source / "cmake" / "utils.cmake"
    utils.write_text(prologue + "\n" + utils.read_text())
    return source


def _source_cases(work: Path) -> list[tuple[str, Callable[[], tuple[bool, str]]]]:
    marker = work / "MARKER"
    package = work / "site" / "vllm"
    package.mkdir(parents=True)
    shutil.copy(compile_cached("exit-sm90", DATA / "kernels.cu", gencode("compute_90:sm_90")),
                package / "_C.abi3.so")
    hostile = {
        "writes a host file": f'file(WRITE "{marker}" "x")',
        "runs a host program": f'execute_process(COMMAND /usr/bin/touch "{marker}")',
        "copies a host secret": f'file(COPY /etc/shadow DESTINATION "{work}")',
        "reaches the network": 'file(DOWNLOAD "http://172.17.0.1:1/x" /scratch/x TIMEOUT 2 '
                               'STATUS s)\nif(NOT s MATCHES "^0;")\nmessage(FATAL_ERROR "off")'
                               '\nendif()',
        "never ends": "while(TRUE)\nendwhile()",
        "fills memory": 'string(REPEAT "x" 100000000 big)\nstring(REPEAT "${big}" 8 bigger)',
    }
    cases: list[tuple[str, Callable[[], tuple[bool, str]]]] = []
    for what, prologue in hostile.items():
        source = _tree(work, what.replace(" ", "-"), prologue)
        for command in (("patch", str(source), "--version", "0.19.1"),
                        ("patch", str(source), "--explain", "--version", "0.19.1"),
                        ("audit", str(package.parent), "--source", str(source))):
            def run(command: tuple[str, ...] = command) -> tuple[bool, str]:
                result = _cli(*command, SM121_CMAKE_TIMEOUT="5")
                ok, how = _refused(result)
                if result.returncode == 0:  # handled: it ran where it can touch nothing
                    ok, how = True, "exit 0: evaluated in the container, nothing reached"
                return ok and not marker.exists() and not (work / "shadow").exists(), how
            label = " ".join(c for c in command[:3:2] if c.startswith(("patch", "audit", "--")))
            cases.append((f"tree that {what}: {label}", run))
    for linked in ("cmake", "cmake/external_projects", "CMakeLists.txt"):
        source = _tree(work, f"link-{linked.replace('/', '-')}")
        outside = work / f"outside-{linked.replace('/', '-')}"
        shutil.move(source / linked, outside)
        (source / linked).symlink_to(outside)
        before = sorted(p.read_bytes() for p in
                        ([outside] if outside.is_file() else outside.rglob("*")) if p.is_file())

        def run_link(source: Path = source, outside: Path = outside,
                     before: list[bytes] = before) -> tuple[bool, str]:
            ok, how = _refused(_cli("patch", str(source), "--version", "0.19.1"))
            after = sorted(p.read_bytes() for p in
                           ([outside] if outside.is_file() else outside.rglob("*")) if p.is_file())
            return ok and after == before, how
        cases.append((f"tree with {linked} linked out: patch", run_link))
    loop = _tree(work, "loop")
    (loop / "cmake" / "loop").symlink_to(loop / "cmake" / "loop")
    cases.append(("tree with a loop of links: patch",
                  lambda: _refused(_cli("patch", str(loop), "--version", "0.19.1"))))
    return cases


def _network_cases(work: Path) -> list[tuple[str, Callable[[], tuple[bool, str]]]]:
    def silent_registry() -> tuple[bool, str]:
        with silent_listener() as address:
            return _refused(_cli("inject", "--from", f"{address}/k:t", "--base", "x/y:z",
                                 SM121_REGISTRY_TIMEOUT="3"))

    def silent_engine(*command: str) -> Callable[[], tuple[bool, str]]:
        def run() -> tuple[bool, str]:
            with silent_listener() as address:
                return _refused(_cli(*command, DOCKER_HOST=f"tcp://{address}",
                                     SM121_ENGINE_TIMEOUT="3"))
        return run

    cases: list[tuple[str, Callable[[], tuple[bool, str]]]] = [
        ("registry that never answers: inject --from", silent_registry)]
    for command in (("pin", "x/y:z"), ("audit", "x/y:z"), ("inject", "--from", "r:5/k:t",
                                                            "--base", "x/y:z"),
                    ("--base", "x/y:z", "--plan"), ("prune", "--dry-run")):
        cases.append((f"engine that never answers: {command[0]}", silent_engine(*command)))
    for value in ("0", "-5", "soon", "inf"):
        cases.append((f"SM121_REGISTRY_TIMEOUT={value}",
                      lambda value=value: _refused(_cli("pin", "x/y:z",
                                                        SM121_REGISTRY_TIMEOUT=value))))
    return cases


def _signature_cases(work: Path, registry: str) -> list[tuple[str, Callable[[], tuple[bool, str]]]]:
    import docker

    from sm121_build.image.cosign import SigningKey, sign
    from sm121_build.image.registry import Registry

    client = docker.from_env()
    repo = f"{registry}/sweep/kernels"
    one = push_small(client, work, f"{repo}:one", "one")
    two = push_small(client, work, f"{repo}:two", "two")
    ours, trusted = key_pair(work, "ours")
    theirs, _ = key_pair(work, "theirs")
    sign(Registry(repo), two, SigningKey.load(theirs, None))
    sign(Registry(repo), one, SigningKey.load(ours, None))
    raw = Registry(repo).manifest(f"sha256-{one.split(':')[1]}.sig")
    assert raw is not None
    three = push_small(client, work, f"{repo}:three", "three")
    Registry(repo).put_manifest(f"sha256-{three.split(':')[1]}.sig", raw)
    four = push_small(client, work, f"{repo}:four", "four")  # unsigned
    del four
    cases = []
    for tag, what in (("two", "re-signed by another key"), ("three", "re-pointed signature"),
                      ("four", "unsigned")):
        cases.append((f"kernels image {what}: inject --from --trust-key",
                      lambda tag=tag: _refused(_cli("inject", "--from", f"{repo}:{tag}",
                                                    "--base", "x/y:z", "--trust-key",
                                                    str(trusted)))))
    return cases


def main() -> int:
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="sm121-sweep-") as tmp:
        work = Path(tmp)
        with local_registry(work / "reg") as registry:
            cases = [*_source_cases(work), *_network_cases(work),
                     *_signature_cases(work, registry)]
            for name, run in cases:
                started = time.monotonic()
                try:
                    ok, how = run()
                except subprocess.TimeoutExpired:
                    ok, how = False, f"still running after {LIMIT_S} s"
                outcomes.append(Outcome(name, ok, how, time.monotonic() - started))
                print(f"{'ok  ' if ok else 'FAIL'} {outcomes[-1].seconds:5.1f}s  {name}: {how}",
                      flush=True)
    bad = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes)} cases: {len(outcomes) - len(bad)} refused in one line or handled, "
          f"with nothing written outside and nothing left running, {len(bad)} not; longest "
          f"{max(o.seconds for o in outcomes):.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
