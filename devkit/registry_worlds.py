"""The whole-run fuzzer's families beyond files (`devkit/worlds.py` runs them with the same
invariants: no traceback, an exit code from the table, no raw control character, bounded
time and memory, nothing left in the temp folder):

- `registry`: the CLI commands that reach the registry client (`kernels verify`, `kernels
  attest`, `inject --from`) against a hostile loopback registry (`devkit/hostile_registry`,
  one MODE a world), with SM121_REGISTRY_TIMEOUT=2: no case over `REGISTRY_BOUND_S` (5 s)
  or 500 MB, none of them large inputs; a concurrent writer's layer is never dropped by a run
  that says it succeeded.  `inject --from` runs against a FAKE engine that answers its first
  calls and then stalls (`devkit/stallengine`), so it goes as far as it can without one.
  A world may also hold a hostile credential helper (`HELPERS`: config.json's `credsStore`
  names `docker-credential-fuzz`, asked when the registry answers 401): missing, hanging
  (ended by SM121_REGISTRY_TIMEOUT, its process gone), flooding, answering nonsense, or
  printing its login and failing (whose Secret no line may show).
- `prove`: `prove --files DIR --stock DIR` with the FAKE GPU interpreter
  (`devkit/fake_gpu`) telling a hostile story (`HOSTILE_CHILD`: floods, escapes, wrong
  types, a child that dies or leaves a grandchild running, a loader that says sizes no GPU
  has), on an aot'd `_C` file or on an FA2-named or Marlin-named one, whose cases are
  derived in the tool's
  own process from its kernels' names and the loader's sizes and run in two parts at once
  (one part's native run floods, dies, or hangs and is interrupted).
- `stall`: a command that reads an image through the engine (`audit IMAGE`, `pin IMAGE`)
  against a FAKE engine that answers its first calls (a reader container made) and then
  stalls (`devkit/stallengine`), with SM121_ENGINE_TIMEOUT=30 and a signal once it stalled:
  the interrupt's clean-up meets the same silence and must still end within 2 s.
- `proof`: the proof-document reader (`kernels attest --proof`, which reads the proof
  before it asks any registry) fed hostile JSON: the real proof with one field made hostile.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devkit.hostile_registry import MODES, HostileRegistry, hostile_registry
from devkit.stallengine import host, stalling_engine
from devkit.worlds import Outcome, _run, fresh_root, remove_root, snapshot

ROOT = Path(__file__).resolve().parent.parent
REAL_PROOF = ROOT / "docs" / "real-build" / "prove-sm90-h200" / "proof.json"
REGISTRY_BOUND_S = 5.0  # the bound: no case over 5 s (its input is small)
KILL_S = 6.5  # a run still going then is killed (and broke the bound)
REGISTRY_COMMANDS = ("verify", "verify_tag", "attest", "inject")
# modes whose `.sig` and `.att` still hold the registry key's valid layer, among others,
# readable with the registry's login (`token-int`'s token is a number, no token at all:
# the registry is then unreadable, exit 7, not a signature that failed to verify)
VALID_AMONG = frozenset({"good", "layer-items", "annotations", "att-types", "sig-65",
                         "sig-10000", "concurrent"})


def proven_files() -> dict[str, str]:
    """name -> sha256 of the files the real proof proves (what the registry's provenance
    lists, so that proof can be attached)."""
    data: dict[str, Any] = json.loads(REAL_PROOF.read_text())
    return {str(item["name"]): str(item["sha256"]) for item in data["files"]}


@dataclass(frozen=True)
class RegistryWorld:
    command: str  # REGISTRY_COMMANDS
    mode: str  # devkit.hostile_registry.MODES
    signum: int | None
    delay: float
    timeout: int = 2  # SM121_REGISTRY_TIMEOUT (9: a flood read whole passes every bound)
    helper: str = ""  # HELPERS: the credential helper config.json names ("": none)


# the credential helper a world's config.json names: what `docker-credential-fuzz get`
# does ("missing": named, not installed); HELPER_SECRET: what no line may show
HELPER_SECRET = "fuzz-secret-4b1d"
HELPERS: dict[str, str] = {
    "": "",
    "missing": "",
    "good": f"read s; echo '{{\"Username\": \"u\", \"Secret\": \"{HELPER_SECRET}\"}}'",
    "hang": "echo $$ > \"$0.pid\"; exec sleep 600",
    "flood": "read s; exec yes '{\"Username\": \"u\",'",
    "nonsense": "read s; printf '\\033[2J\\n{[}'",
    "secret-fail": f"echo '{{\"Username\": \"u\", \"Secret\": \"{HELPER_SECRET}\"}}'; "
                   f"echo 'Secret {HELPER_SECRET}' >&2; exit 1",
}


def _with_helper(kind: str, root: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` with config.json naming the world's helper and the helper on PATH."""
    if not kind:
        return env
    (root / "home" / "docker" / "config.json").write_text('{"credsStore": "fuzz"}')
    if kind == "missing":
        return env
    folder = root / "bin"
    folder.mkdir(exist_ok=True)
    program = folder / "docker-credential-fuzz"
    program.write_text(f"#!/bin/sh\n{HELPERS[kind]}\n")
    program.chmod(0o755)
    return {**env, "PATH": f"{folder}:{env.get('PATH', '')}"}


def _helper_kept(world: RegistryWorld, root: Path, outcome: Outcome) -> None:
    """The helper's Secret in no line; a hanging helper's process gone with the run."""
    if HELPER_SECRET in outcome.said and world.helper != "good":
        outcome.broken.append("a credential helper's Secret was shown")
    pid_file = root / "bin" / "docker-credential-fuzz.pid"
    if world.helper == "hang" and pid_file.exists():
        stat = Path(f"/proc/{pid_file.read_text().strip()}/stat")
        with contextlib.suppress(OSError, IndexError):
            if stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                outcome.broken.append("a hanging credential helper was left running")


def _base_env(root: Path) -> dict[str, str]:
    home, tmp = root / "home", root / "tmp"
    for made in (home, tmp, home / "docker"):
        made.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "XDG_CACHE_HOME": str(home / "cache"),
           "XDG_STATE_HOME": str(home / "state"), "HOME": str(home), "COLUMNS": "120",
           "DOCKER_CONFIG": str(home / "docker"), "SM121_REGISTRY_TIMEOUT": "2",
           "SM121_ENGINE_TIMEOUT": "1", "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    for name in ("CUDA_HOME", "COSIGN_PASSWORD", "SM121_TRUST_KEY"):
        env.pop(name, None)
    return env


def _registry_args(world: RegistryWorld, registry: HostileRegistry, keys: tuple[Path, Path]
                   ) -> list[str]:
    private, public = keys
    ref = registry.ref(world.mode, by_digest=world.command != "verify_tag")
    if world.command.startswith("verify"):
        return ["kernels", "verify", ref, "--trust-key", str(public)]
    if world.command == "attest":
        return ["kernels", "attest", ref, "--proof", str(REAL_PROOF), "--sign-key",
                str(private), "--partial-proof"]  # format 2: read as partial (issue 63)
    return ["inject", "--from", ref, "--trust-key", str(public), "--base", "some/image"]


def run_registry_world(world: RegistryWorld, registry: HostileRegistry, root: Path) -> Outcome:
    """One command against `registry` in `world.mode`; every invariant checked."""
    env = _with_helper(world.helper, root,
                       {**_base_env(root), "SM121_REGISTRY_TIMEOUT": str(world.timeout)})
    keys = registry.keys(root)
    before = snapshot(root, (root / "tmp", root / "home", root / "bin"))
    lost = registry.lost
    args = _registry_args(world, registry, keys)
    if world.command == "inject":
        with stalling_engine() as engine:
            outcome = _run(world, args, {**env, "DOCKER_HOST": host(engine)}, KILL_S,
                           REGISTRY_BOUND_S)
    else:
        outcome = _run(world, args, env, KILL_S, REGISTRY_BOUND_S)
    _left(outcome, root, before, (root / "tmp", root / "home", root / "bin"))
    _helper_kept(world, root, outcome)
    if registry.lost > lost and outcome.code == 0:
        outcome.broken.append("another writer's layer was dropped by a write that said it "
                              "succeeded")
    if world.mode in VALID_AMONG and world.signum is None and world.command != "inject" \
            and world.helper in ("", "good") and outcome.code != 0:
        outcome.broken.append(f"a valid signature among others (or alone) did not verify "
                              f"(require_signed: whoever can push beside the image cannot "
                              f"stop a consumer's run): exit {outcome.code}: "
                              f"{outcome.said[-300:]}")
    return outcome


def _left(outcome: Outcome, root: Path, before: dict[str, tuple[object, ...]],
          skip: tuple[Path, ...] = ()) -> None:
    """Nothing left in the temp folder (unless the run was killed: it could clean nothing)
    and nothing else changed."""
    left = list((root / "tmp").iterdir())
    if left and outcome.code != -1:
        outcome.broken.append(f"left in the temp folder: {left[:4]}")
    after = snapshot(root, skip or (root / "tmp", root / "home"))
    changed = sorted(set(before.items()) ^ set(after.items()))
    if changed:
        outcome.broken.append(f"inputs or unrelated files changed: {changed[:4]}")


# -- a signal while the engine stalls ---------------------------------------------------

STALL_COMMANDS = ("audit", "pin")
STALL_ENGINE_S = 30  # SM121_ENGINE_TIMEOUT: the clean-up after a signal must not wait it
STALL_KILL_S = 12.0


@dataclass(frozen=True)
class StallWorld:
    command: str  # STALL_COMMANDS
    signum: int | None
    delay: float  # after the engine stalled


def run_stall_world(world: StallWorld, root: Path) -> Outcome:
    """`COMMAND some/image` against a stalling engine, the signal sent `delay` s after it
    stalled; every invariant (from the signal to the end: at most 2 s)."""
    env = {**_base_env(root), "SM121_ENGINE_TIMEOUT": str(STALL_ENGINE_S)}
    before = snapshot(root, (root / "tmp", root / "home"))
    with stalling_engine() as engine:
        outcome = _run(world, [world.command, "some/image"],
                       {**env, "DOCKER_HOST": host(engine)}, STALL_KILL_S,
                       ready=engine.stalled)
    _left(outcome, root, before)
    if world.signum is not None and outcome.code != 130:
        outcome.broken.append(f"a signal while the engine stalled: exit {outcome.code}, not "
                              f"130: {outcome.said[-300:]}")
    return outcome


# -- prove --files with a hostile FAKE GPU -------------------------------------------------

# what the FAKE interpreter says instead of a GPU's answer (FAKE_HOSTILE) at one payload
# (FAKE_AT); the other payloads answer as devkit.fake_gpu's proven story.  Each a story no
# GPU tells, which prove must take as outside input
HOSTILE_CHILD = ("flood", "longline", "escapes", "types", "die", "grandchild", "silent-exit",
                 "binary", "deep", "hang", "answers", "sizes")
OVER_BUDGET = 30_000  # `answers`: valid, distinct answers, past what one child's may keep
# `part`: the native run of a part of derived cases other than the first (`--derived-only`:
# an FA2-named file, whose cases are dealt to parts run at once, `FA2_PAIR`)
HOSTILE_AT = ("load_cubins.py", "harness_", "compare_outputs.py", "part")
# `sizes`: a loader that says a GPU no GPU is (the dispatch's sizes: 1 byte of shared memory
# per block, 2**31 - 1 per SM, one SM), its story otherwise the proven one: an FA2 file's
# cases are derived from it, in bounded time; it may be proven (the sizes are not checked)
LYING_SIZES = {"smem_block": 1, "smem_sm": 2**31 - 1, "sms": 1}
PROVE_JOBS = "4"  # prove --jobs: an FA2-named file's two modules, two parts at once (and
# its fixed cases, which launch no added kernel of it, a third)
_DEALT = re.compile(r"derived from its added kernels, in [2-4] part\(s\)")
PROVE_TIMEOUT = "2"  # prove --timeout: a child that floods or hangs is ended then
PROVE_BOUND_S = 20.0


@dataclass(frozen=True)
class ProveWorld:
    mode: str  # HOSTILE_CHILD
    at: str  # HOSTILE_AT: the payload that tells it
    signum: int | None
    delay: float  # after the start, or at `part`, after the hostile child began to hang
    fa2: bool = False  # the FA2-named pair (derived cases, two parts), not the `_C` one
    marlin: bool = False  # the Marlin-named `_C` pair (derived marlin_gemm cases, two parts)


HOSTILE_PYTHON = r"""
import json, os, subprocess, sys, time
from pathlib import Path
mode, at = os.environ["FAKE_HOSTILE"], os.environ["FAKE_AT"]
script = Path(sys.argv[1]).name
here = script.startswith("harness_") and "--derived-only" in sys.argv and \
    os.environ.get("CUDA_DISABLE_PTX_JIT") == "1" and "/stock/" not in sys.argv[2] \
    if at == "part" else script.startswith(at)
if mode == "sizes":
    os.environ["FAKE_SIZES"] = os.environ["FAKE_LYING_SIZES"]
if not here or mode == "sizes":
    os.environ["FAKE_MODE"] = "proven"
    exec(compile(os.environ["FAKE_STORY"], "fake", "exec"))
    sys.exit(0)
def say(**data): print(json.dumps(data), flush=True)
if at == "load_cubins.py" and mode != "types":
    say(device={"name": "FAKE GB10", "major": 12, "minor": 1, "driver": 13000,
                "version": "580.95.05"})
if mode == "flood":
    while True:
        print("x" * 4096 + " flood")
if mode == "hang":
    if at == "part":  # said, so that the signal is sent while it hangs
        Path(os.environ["FAKE_PIDS"], str(os.getpid())).write_text(str(os.getpid()))
    time.sleep(600)
if mode == "longline":
    sys.stdout.write("{" * (64 << 20)); sys.stdout.flush(); sys.exit(0)
if mode == "escapes":
    say(device={"name": "GB10\x1b]0;owned\x07\n\u202e\x9b2J", "major": 12, "minor": 1,
                "driver": 13000, "version": "580\x1b[2J"})
    say(op="gptq\x1b[2J", case="c\nfake: all native", first_s=1.0)
    say(key="k\x1b]0;x\x07", bitwise_equal=True, max_abs_diff=0.0, max_ulp=0)
    say(error="\x1b[31mfailed\x1b[0m\r\nfake: all native"); sys.exit(3)
if mode == "types":
    say(device={"name": 5, "major": "12", "minor": None, "driver": [], "version": {}})
    say(cubin=[1], loaded="yes", found=-1, missing={"a": 1}, missing_count=1e308)
    say(op=5, case=[], first_s="x"); say(key={}, bitwise_equal="yes", max_ulp=-1)
    say(done="all", saved=-5); print("[]"); print("1e999"); print('{"cubin": ' + "9" * 5000 + "}")
    sys.exit(0)
if mode == "die":
    os.kill(os.getpid(), 9)
if mode == "grandchild":
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path(os.environ["FAKE_PIDS"], str(child.pid)).write_text(str(child.pid))
    sys.exit(0)
if mode == "answers":
    for number in range(int(os.environ["FAKE_ANSWERS"])):
        say(op="gptq", case=f"c{number}", first_s=1.0, key=f"gptq/c{number}",
            bitwise_equal=True, max_abs_diff=0.0, max_ulp=0)
    sys.exit(0)
if mode == "binary":
    sys.stdout.buffer.write(bytes(range(256)) * 64 + b"\xff\xfe\n"); sys.exit(0)
if mode == "deep":
    print("[" * 100000 + "]" * 100000); sys.exit(0)
sys.exit(0)
"""


def hostile_python(path: Path, interpreter: str) -> Path:
    path.write_text(f"#!{interpreter}\n" + HOSTILE_PYTHON)
    path.chmod(0o755)
    return path


def run_prove_world(world: ProveWorld, pair: tuple[Path, Path], root: Path) -> Outcome:
    """`prove --files --stock --json` with the hostile FAKE interpreter; every invariant."""
    from devkit.fake_gpu import FAKE_PYTHON

    env = _base_env(root)
    pids = root / "pids"
    pids.mkdir()
    python = hostile_python(root / "FAKE-python", _interpreter())
    out = root / "out" / "proof.json"
    skip = (root / "tmp", root / "home", root / "out", pids)
    before = snapshot(root, skip)
    outcome = _run(world, ["prove", "--files", str(pair[0]), "--stock", str(pair[1]),
                           "--json", str(out), "--python", str(python), "--timeout",
                           PROVE_TIMEOUT, "--jobs", PROVE_JOBS],
                   {**env, "FAKE_HOSTILE": world.mode, "FAKE_AT": world.at,
                    "FAKE_PIDS": str(pids), "FAKE_STORY": FAKE_PYTHON,
                    "FAKE_ANSWERS": str(OVER_BUDGET),
                    "FAKE_LYING_SIZES": json.dumps(LYING_SIZES)},
                   PROVE_BOUND_S + 10, PROVE_BOUND_S,
                   ready=_hanging(pids) if world.at == "part" and world.signum else None)
    _left(outcome, root, before, skip)
    for record in pids.iterdir():
        pid = int(record.read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        outcome.broken.append(f"a program it started is still running (pid {pid})")
        os.kill(pid, signal.SIGKILL)
    if outcome.code == 0 and world.signum is None and world.mode not in ("silent-exit",
                                                                           "sizes"):
        outcome.broken.append("a hostile child's story was taken for a proof (exit 0)")
    if world.signum is not None and outcome.code != 130:
        outcome.broken.append(f"a signal while a child hung: exit {outcome.code}, not 130: "
                              f"{outcome.said[-300:]}")
    derives = world.at != "load_cubins.py" or world.mode == "sizes"  # the loader answers
    if (world.fa2 or world.marlin) and derives and not _DEALT.search(outcome.said):
        outcome.broken.append(f"a file named as FA2's or Marlin's had its cases not derived "
                              f"and dealt to parts: {outcome.said[-300:]}")
    if world.mode == "answers" and world.signum is None and "said more than" not in \
            outcome.said:
        outcome.broken.append(f"a child's {OVER_BUDGET:,} answers, past what one child's "
                              f"may keep, were not refused so: exit {outcome.code}: "
                              f"{outcome.said[-300:]}")
    return outcome


def _hanging(pids: Path) -> threading.Event:
    """Set once a hostile child that hangs has written its pid under `pids`."""
    ready = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + PROVE_BOUND_S
        while time.monotonic() < deadline:
            try:
                if any(pids.iterdir()):
                    ready.set()
                    return
            except OSError:  # the world is gone: the run ended first
                return
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    return ready


def _interpreter() -> str:
    import sys

    return sys.executable


# -- the proof-document reader with hostile JSON ------------------------------------------

# values a field of a proof may be made: each of a wrong type, out of bounds, or text a
# terminal would act on
HOSTILE_VALUES: tuple[object, ...] = (
    None, True, -1, 2**63, 10**400, 1e308, float("nan"), "", "\x1b]0;x\x07\n\u202e",
    "\ud800", "x" * 100_000, [], {}, [[[[[]]]]], {"a": None})


def proof_paths(value: object, at: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every path to a value in a JSON document (keys and indexes), the root's included."""
    found = [at]
    if isinstance(value, dict):
        for key, item in value.items():
            found += proof_paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:2]):
            found += proof_paths(item, (*at, index))
    return found


TWICE = "\x00twice\x00"  # where the key given twice goes (a text no proof holds)


def covered_proof() -> dict[str, Any]:
    """The real proof as format 3, its coverage made up (FAKE: `devkit.fake_gpu.covered`),
    two kernels of `_C.abi3.so` never launched: so the coverage fields are made hostile too."""
    from devkit.fake_gpu import covered

    return covered(json.loads(REAL_PROOF.read_text()),
                   {"_C.abi3.so": ["_Z6never1v", "_Z6never2v"]})


def hostile_proof(path: tuple[str | int, ...], value: object, twice: bool = False,
                  base: Any = None) -> str:
    """The real proof (or `base`) with the value at `path` replaced by `value`, as JSON
    text (Python's json writes NaN and a lone surrogate as a hostile document would);
    `twice`: the key at `path` given twice in its object, `value` first and the real value
    last (what Python's json keeps: another reader may keep the first, two documents under
    one signature)."""
    data: Any = json.loads(REAL_PROOF.read_text()) if base is None else \
        json.loads(json.dumps(base))
    if not path:
        return json.dumps(value)
    holder = data
    for step in path[:-1]:
        holder = holder[step]
    if not twice:
        holder[path[-1]] = value
        return json.dumps(data)
    assert isinstance(path[-1], str), "only an object's key can be given twice"
    real, holder[path[-1]] = holder[path[-1]], TWICE
    key = json.dumps(path[-1])
    return json.dumps(data).replace(f"{key}: {json.dumps(TWICE)}",
                                    f"{key}: {json.dumps(value)}, {key}: {json.dumps(real)}")


@dataclass(frozen=True)
class ProofWorld:
    path: tuple[str | int, ...]
    value: object
    signum: int | None = None
    delay: float = 0.0
    twice: bool = False  # the key given twice: `value` first, the real value last


def run_proof_world(world: ProofWorld, root: Path) -> Outcome:
    """`kernels attest --proof HOSTILE` (no registry is asked before the proof is read):
    refused in one line (exit 2 or 3), never a traceback."""
    env = _base_env(root)
    proof = root / "proof.json"
    proof.write_text(hostile_proof(world.path, world.value, world.twice), encoding="utf-8",
                     errors="surrogatepass")
    private = root / "k.key"
    from devkit.keys import key_pair

    private, _public = key_pair(root, "k")
    before = snapshot(root, (root / "tmp", root / "home"))
    outcome = _run(world, ["kernels", "attest", "127.0.0.1:9/x/k@sha256:" + "0" * 64,
                           "--proof", str(proof), "--sign-key", str(private),
                           "--partial-proof"], env,
                   KILL_S, REGISTRY_BOUND_S)
    _left(outcome, root, before)
    if outcome.code == 0:
        outcome.broken.append("a hostile proof was attached")
    if world.twice and world.signum is None and (
            outcome.code != 2 or "not a proof document" not in outcome.said):
        outcome.broken.append(f"a key given twice was not refused as no proof document "
                              f"(exit {outcome.code}): one reader's proof is another's "
                              f"refusal: {outcome.said[-200:]}")
    return outcome


def random_registry_world(rng: random.Random) -> RegistryWorld:
    return RegistryWorld(rng.choice(REGISTRY_COMMANDS), rng.choice(MODES),
                         rng.choice((None, None, None, signal.SIGINT, signal.SIGTERM)),
                         rng.choice((0.3, 0.6, 1.0)), helper=rng.choice(list(HELPERS)))


def run_registry_family(runs: int, rng: random.Random) -> int:
    """`python -m devkit.worlds --family registry`: `runs` random registry worlds, each
    broken invariant printed; how many broke one."""
    broken = 0
    with hostile_registry(proven_files()) as registry:
        for i in range(runs):
            world = random_registry_world(rng)
            root = fresh_root()
            try:
                outcome = run_registry_world(world, registry, root)
            finally:
                remove_root(root)
            if outcome.broken:
                broken += 1
                print(f"run {i}: {world}\n  " + "\n  ".join(outcome.broken), flush=True)
    return broken
