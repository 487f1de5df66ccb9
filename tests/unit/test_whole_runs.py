"""The whole-run fuzzer (`devkit/worlds.py`): generated hostile worlds × commands × option
values × a signal at a random moment; every run keeps every invariant.  CI runs a fixed,
derandomized budget; `SM121_WORLDS=500 SM121_FUZZ_RANDOM=1` a longer, new run, and
`python -m devkit.worlds --runs N` the nightly's."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from devkit import ci_worlds as cw
from devkit import registry_worlds as rw
from devkit import summary_worlds, worlds
from devkit.helpers import EMULATED, EMULATED_WHY, aot_pair_of, cuda_home
from devkit.hostile_registry import MODES, HostileRegistry, hostile_registry
from sm121_build.jobs.proofs.proof_reading import NotAProof, summarise

EXAMPLES = int(os.environ.get("SM121_WORLDS", "40"))
RANDOM = os.environ.get("SM121_FUZZ_RANDOM") == "1"

# Worlds of issue #54's classes, kept as seeds; the first four broke an invariant on 134a60e
# (a forged line, a SIGTERM that waited for ptxas, a ptxas's child left running, exit -2
# after "interrupted"), the others hold each door's promise (a mutant of
# benchmarks/promise_mutants.yaml re-opens one and must break one of these).
FOUND = (
    worlds.World((("elf", "l\nfake: all native.so"),), "none", "none", "audit_md", "2", None,
                 None, 0.0),
    worlds.World((("jit", "k.so"),), "hang", "none", "aot", "600", None, signal.SIGTERM,
                 0.8),
    worlds.World((("jit", "k.so"),), "fork", "none", "aot", "2", None, None, 0.0),
    worlds.World((), "lie", "cache_link", "audit_json", "0", "sm_121a", signal.SIGINT,
                 0.08),
    worlds.World((("jit", "k.so"),), "flood", "none", "aot_file", "2", "sm_121", None, 0.0),
    worlds.World((("jit", "k.so"),), "real", "cache_link", "aot", "600", None, None, 0.0),
    worlds.World((("jit", "k.so"),), "real", "state_unwritable", "aot", "nan", "", None, 0.0),
    worlds.World((("jit", "k.so"),), "real", "none", "aot", "inf", None, None, 0.0),
    worlds.World((("wheel_dot", "w"),), "real", "none", "audit_file", "2", None, None, 0.0),
    worlds.World((("nested", "n.so"),), "none", "none", "audit", "2", None, None, 0.0),
    worlds.World((("jit", "k\x1b]0;x\x07.so"),), "die", "none", "aot", "2", None,
                 signal.SIGINT, 0.3),
)


@pytest.fixture(scope="module")
def seeds(plain_so: Path, jit_only_so: Path) -> worlds.Seeds:
    return worlds.Seeds(plain_so, jit_only_so, cuda_home())


def _check(world: worlds.World, seeds: worlds.Seeds) -> None:
    root = worlds.fresh_root()
    try:
        outcome = worlds.run_world(world, seeds, root)
    finally:
        worlds.remove_root(root)
    assert outcome.broken == [], (world, outcome.code, outcome.broken)


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize("world", FOUND, ids=[f"found{i}" for i in range(len(FOUND))])
def test_a_world_that_once_broke_an_invariant(world: worlds.World,
                                              seeds: worlds.Seeds) -> None:
    _check(world, seeds)


_WORLDS = st.builds(
    worlds.World,
    st.lists(st.tuples(st.sampled_from(worlds.KINDS), st.sampled_from(worlds.NAMES)),
             max_size=4).map(tuple),
    st.sampled_from(worlds.PTXAS), st.sampled_from(worlds.PLANTS),
    st.sampled_from(worlds.COMMANDS), st.sampled_from(worlds.TIMEOUTS),
    st.sampled_from(worlds.TARGETS),
    st.sampled_from((None, None, signal.SIGINT, signal.SIGTERM)),
    st.floats(0.05, 1.5).map(lambda d: round(d, 2)))


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
def test_generated_worlds_keep_every_invariant(seeds: worlds.Seeds) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_WORLDS)
    def one(world: worlds.World) -> None:
        _check(world, seeds)

    one()


# -- the registry family (devkit/registry_worlds.py): the commands that reach the registry
# client against a hostile loopback registry (devkit/hostile_registry.py), one mode a world

HOLDS = (
    *[rw.RegistryWorld("verify", mode, None, 0.0) for mode in (
        "good", "flood-manifest", "floodlen-manifest", "flood-blob", "token-int",
        "layers-dict", "layers-str", "layer-items", "annotations", "att-types",
        "redirect-loop", "status-500", "status-401")],
    rw.RegistryWorld("verify_tag", "good", None, 0.0),
    rw.RegistryWorld("attest", "good", None, 0.0),
    rw.RegistryWorld("attest", "att-types", None, 0.0),
    rw.RegistryWorld("inject", "good", None, 0.0),
    rw.RegistryWorld("inject", "floodlen-blob", None, 0.0),
    rw.RegistryWorld("verify", "drip", signal.SIGINT, 1.0),
    rw.RegistryWorld("attest", "flood-upload", signal.SIGTERM, 1.2),
    # a flood without a length and a deadline past the run's bounds (9 s of 64 MB/s: read
    # whole, over 5 s and 500 MB): refused at its size at once, not at the deadline
    rw.RegistryWorld("verify", "flood-token", None, 0.0, 9),
    # a hostile credential helper config.json names, asked on the registry's 401: one line
    # within the bound, its Secret never shown, a hanging one ended with the run's deadline
    *[rw.RegistryWorld(command, mode, None, 0.0, helper=helper)
      for command, mode, helper in (
          ("verify", "token-int", "missing"), ("verify", "token-int", "hang"),
          ("verify", "status-401", "flood"), ("attest", "token-list", "nonsense"),
          ("verify", "token-int", "secret-fail"), ("verify", "status-401", "good"))],
    rw.RegistryWorld("verify", "token-int", signal.SIGINT, 0.8, helper="hang"),
)
# Each broke an invariant on 81e1ac3, before issue #62's registry client (what it broke is
# said beside it); each holds now, a seed like the others
KNOWN = (
    (rw.RegistryWorld("verify", "drip", None, 0.0), "a valid answer 1 byte a second: no "
     "bound on the whole answer (ran past 5 s)"),
    (rw.RegistryWorld("verify", "flood-token", None, 0.0), "the token answer is read whole, "
     "without a bound (ran past 5 s, memory without end)"),
    (rw.RegistryWorld("verify", "token-list", None, 0.0), "a token answer `[]`: a traceback "
     "(AttributeError in Registry._login)"),
    (rw.RegistryWorld("verify", "att-sigs", None, 0.0), "45,000 empty signatures over a "
     "390 KB statement: each checked over the whole statement (ran past 5 s)"),
    (rw.RegistryWorld("verify", "sig-65", None, 0.0), "a .sig of 65 layers (the 65th an "
     "append) holding valid signatures: refused whole as not a signature manifest (exit 3), "
     "so whoever can push beside the image stops a consumer's run"),
    (rw.RegistryWorld("verify", "sig-10000", None, 0.0), "10,000 layers, the last one valid: "
     "refused whole (exit 3)"),
    (rw.RegistryWorld("attest", "flood-upload", None, 0.0), "the answer to POST of an upload "
     "is read whole, without a bound (ran past 5 s)"),
    (rw.RegistryWorld("attest", "concurrent", None, 0.0), "another writer's layer, appended "
     "just before attest's read of the .att manifest, is dropped by a write that says it "
     "succeeded"),
)
ALL_REGISTRY = os.environ.get("SM121_REGISTRY_WORLDS") == "all"  # every command x mode


@pytest.fixture(scope="module")
def registry() -> Iterator[HostileRegistry]:
    with hostile_registry(rw.proven_files()) as server:
        yield server


def _registry_check(world: rw.RegistryWorld, registry: HostileRegistry) -> None:
    root = worlds.fresh_root()
    try:
        outcome = rw.run_registry_world(world, registry, root)
    finally:
        worlds.remove_root(root)
    assert outcome.broken == [], (world, outcome.code, outcome.broken, outcome.said[-300:])


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize("world", HOLDS, ids=[f"{w.command}-{w.mode}-{w.signum}-{w.timeout}s"
                                              f"{'-' + w.helper if w.helper else ''}"
                                              for w in HOLDS])
def test_a_hostile_registry_keeps_every_invariant(world: rw.RegistryWorld,
                                                  registry: HostileRegistry) -> None:
    _registry_check(world, registry)


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize("world", [world for world, _broke_before in KNOWN],
                         ids=[f"{w.command}-{w.mode}" for w, _ in KNOWN])
def test_a_hostile_registry_the_client_fix_must_survive(world: rw.RegistryWorld,
                                                        registry: HostileRegistry) -> None:
    _registry_check(world, registry)


@pytest.mark.skipif(not ALL_REGISTRY, reason="SM121_REGISTRY_WORLDS=all: every command "
                    "against every mode (minutes)")
@pytest.mark.parametrize("command", rw.REGISTRY_COMMANDS)
def test_every_mode_against_every_command(command: str, registry: HostileRegistry) -> None:
    broken = {}
    for mode in MODES:
        root = worlds.fresh_root()
        try:
            outcome = rw.run_registry_world(rw.RegistryWorld(command, mode, None, 0.0),
                                            registry, root)
        finally:
            worlds.remove_root(root)
        if outcome.broken:
            broken[mode] = outcome.broken
    assert broken == {}


# -- prove --files with a hostile FAKE GPU, and the proof-document reader -----------------

PROVE = (rw.ProveWorld("flood", "load_cubins.py", None, 0.0),
         rw.ProveWorld("types", "load_cubins.py", None, 0.0),
         rw.ProveWorld("grandchild", "load_cubins.py", None, 0.0),
         rw.ProveWorld("escapes", "harness_", None, 0.0),
         rw.ProveWorld("die", "harness_", None, 0.0),
         rw.ProveWorld("deep", "compare_outputs.py", None, 0.0),
         rw.ProveWorld("hang", "harness_", signal.SIGINT, 0.8),
         rw.ProveWorld("answers", "harness_", None, 0.0),
         # an FA2-named file: cases derived here, two parts at once (issue 63)
         rw.ProveWorld("sizes", "load_cubins.py", None, 0.0, fa2=True),
         rw.ProveWorld("types", "load_cubins.py", None, 0.0, fa2=True),
         rw.ProveWorld("flood", "part", None, 0.0, fa2=True),
         rw.ProveWorld("die", "part", None, 0.0, fa2=True),
         rw.ProveWorld("escapes", "part", None, 0.0, fa2=True),
         rw.ProveWorld("hang", "part", signal.SIGINT, 0.3, fa2=True),
         rw.ProveWorld("hang", "part", signal.SIGTERM, 0.3, fa2=True),
         # a Marlin-named `_C`: marlin_gemm cases derived here, two parts at once
         rw.ProveWorld("sizes", "load_cubins.py", None, 0.0, marlin=True),
         rw.ProveWorld("die", "part", None, 0.0, marlin=True),
         rw.ProveWorld("hang", "part", signal.SIGINT, 0.3, marlin=True))


@pytest.fixture(scope="module")
def prove_pair(jit_only_so: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(--files, --stock) as tests/unit/test_prove.py makes them: an aot'd `_C.abi3.so`
    and its stock file."""
    return aot_pair_of(jit_only_so, "_C.abi3.so", tmp_path_factory.mktemp("prove-worlds"))


@pytest.fixture(scope="module")
def fa2_pair(fa2_names_so: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, Path]:
    """(--files, --stock): an aot'd `_vllm_fa2_C.abi3.so` whose added kernels are named as
    FA2's, in two modules, and its stock file."""
    return aot_pair_of(fa2_names_so, "_vllm_fa2_C.abi3.so",
                       tmp_path_factory.mktemp("prove-fa2-worlds"))


@pytest.fixture(scope="module")
def marlin_pair(marlin_names_so: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[Path, Path]:
    """(--files, --stock): an aot'd `_C.abi3.so` whose added kernels are named as vLLM's
    Marlin GEMM kernels, in two modules, and its stock file."""
    return aot_pair_of(marlin_names_so, "_C.abi3.so",
                       tmp_path_factory.mktemp("prove-marlin-worlds"))


def _world_id(world: rw.ProveWorld) -> str:
    signal_name = f"-{signal.Signals(world.signum).name}" if world.signum else ""
    named = "-fa2" if world.fa2 else "-marlin" if world.marlin else ""
    return f"{world.at}-{world.mode}{signal_name}{named}"


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize("world", PROVE, ids=[_world_id(w) for w in PROVE])
def test_a_hostile_gpu_child_keeps_every_invariant(world: rw.ProveWorld,
                                                   request: pytest.FixtureRequest) -> None:
    pair = request.getfixturevalue("fa2_pair" if world.fa2 else "marlin_pair" if world.marlin
                                   else "prove_pair")
    root = worlds.fresh_root()
    try:
        outcome = rw.run_prove_world(world, pair, root)
    finally:
        worlds.remove_root(root)
    assert outcome.broken == [], (world, outcome.code, outcome.broken)


def test_every_field_of_a_proof_made_hostile_is_refused_or_read() -> None:
    """The reader (`summarise`) over the real proof with each field in turn made each
    hostile value: a NotAProof, or a summary whose line has no raw control character."""
    tried = 0
    for document in (json.loads(rw.REAL_PROOF.read_text()), rw.covered_proof()):
        for path in rw.proof_paths(document):
            for value in rw.HOSTILE_VALUES:
                tried += 1
                try:
                    line = summarise(json.loads(rw.hostile_proof(
                        path, value, base=document))).line()
                except NotAProof:
                    continue
                assert not worlds.RAW.search(line), (path, value, line)
    assert tried > 2000


# a key given twice, the hostile value first and the real last: a strict reader's refusal
TWICE = (rw.ProofWorld(("verdict",), "failed", twice=True),
         rw.ProofWorld(("gpu", "target"), "sm_121", twice=True))


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize("world", TWICE, ids=["-".join(map(str, w.path)) for w in TWICE])
def test_a_proof_with_a_key_given_twice_is_no_proof(world: rw.ProofWorld) -> None:
    root = worlds.fresh_root()
    try:
        outcome = rw.run_proof_world(world, root)
    finally:
        worlds.remove_root(root)
    assert outcome.broken == [], (world, outcome.code, outcome.broken)


_PROOFS = st.builds(rw.ProofWorld,
                    st.sampled_from(rw.proof_paths(json.loads(rw.REAL_PROOF.read_text()))),
                    st.sampled_from(rw.HOSTILE_VALUES))


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
def test_a_hostile_proof_document_through_the_cli() -> None:
    @settings(max_examples=max(EXAMPLES // 8, 3), deadline=None, derandomize=not RANDOM,
              database=None, suppress_health_check=list(HealthCheck))
    @given(_PROOFS)
    def one(world: rw.ProofWorld) -> None:
        root = worlds.fresh_root()
        try:
            outcome = rw.run_proof_world(world, root)
        finally:
            worlds.remove_root(root)
        assert outcome.broken == [], (world.path, outcome.code, outcome.broken)

    one()


# -- a signal while the engine stalls (devkit/registry_worlds.py's `stall` family) ---------

STALLS = (rw.StallWorld("audit", signal.SIGINT, 0.2), rw.StallWorld("pin", signal.SIGTERM, 0.5))


@pytest.mark.skipif(EMULATED, reason=EMULATED_WHY)
@pytest.mark.parametrize("world", STALLS, ids=[f"{w.command}-{w.signum}" for w in STALLS])
def test_a_signal_while_the_engine_stalls_keeps_every_invariant(world: rw.StallWorld) -> None:
    root = worlds.fresh_root()
    try:
        outcome = rw.run_stall_world(world, root)
    finally:
        worlds.remove_root(root)
    assert outcome.broken == [], (world, outcome.code, outcome.broken, outcome.said[-300:])


# -- the summary family (devkit/summary_worlds.py): the Markdown of --summary-md from records
# whose every string is drawn hostile

_PIECE = st.sampled_from(summary_worlds.PIECES)
_HOSTILE_TEXT = st.one_of(
    st.lists(st.one_of(_PIECE, st.text(max_size=6)), max_size=8).map("".join),
    st.text(max_size=40),
    st.tuples(_PIECE, st.integers(1100, 60_000)).map(lambda p: p[0] * (p[1] // len(p[0]))))
_SHORT_TEXT = st.lists(st.one_of(_PIECE, st.text(max_size=6)), max_size=6).map("".join)


def _values(fields: tuple[str, ...], short: frozenset[str] = frozenset()
            ) -> st.SearchStrategy[dict[str, str]]:
    return st.fixed_dictionaries({f: _SHORT_TEXT if f in short else _HOSTILE_TEXT
                                  for f in fields})


SUMMARY_EXAMPLES = max(EXAMPLES * 2, 60)
# no shrinking: a broken invariant is shown as drawn (a shrunk example reads better, but
# the promise mutants' step would wait ~20 s for it)
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def test_the_main_jobs_summary_of_generated_hostile_records() -> None:
    @settings(max_examples=SUMMARY_EXAMPLES, deadline=None, derandomize=not RANDOM,
              database=None, suppress_health_check=list(HealthCheck), phases=NO_SHRINK)
    @given(_values(summary_worlds.FIELDS, summary_worlds.JOINED),
           st.sampled_from(("hit", "refused", "miss")))
    def one(values: dict[str, str], outcome: str) -> None:
        assert summary_worlds.broken_run_summary(values, outcome) == []

    one()


def test_the_audits_summary_of_generated_hostile_reports() -> None:
    @settings(max_examples=SUMMARY_EXAMPLES, deadline=None, derandomize=not RANDOM,
              database=None, suppress_health_check=list(HealthCheck), phases=NO_SHRINK)
    @given(_values(summary_worlds.AUDIT_FIELDS))
    def one(values: dict[str, str]) -> None:
        assert summary_worlds.broken_audit_summary(values) == []

    one()


# -- the ci family (devkit/ci_worlds.py): .ci/system in a mount namespace of its own against a
# hostile machine (a docker that hangs, floods, exits odd; sockets; links planted in /tmp)

CI = (cw.CiWorld("hang", "none", "log-link", "docker-ce", None, True),
      cw.CiWorld("hang-child", "silent", "dir-link", "docker.io", None, True),
      cw.CiWorld("fails", "full", "none", "docker.io", "unix://SOCKET", True),
      cw.CiWorld("answers", "stale", "log-link", "docker-ce-cli", "tcp://127.0.0.1:9", False))
# each broke an invariant before issue #62's fix of .ci/system (what, beside it)
CI_ONCE_BROKEN = (
    (cw.CiWorld("fails", "none", "log-link", "none", None, True), "an engine it started that "
     "never answers: exit 1 with no error line"),
    (cw.CiWorld("fails", "none", "none", "docker-ce", "unix://a b\nerror: forged", True),
     "DOCKER_HOST echoed raw: a second `error:` line"),
    (cw.CiWorld("fails", "none", "none", "docker-ce", "unix://\x1b]0;x\x07", True),
     "DOCKER_HOST echoed raw: a raw control character"))


def _ci_check(world: cw.CiWorld) -> None:
    why = cw.ci_unavailable()
    if why is not None:
        pytest.skip(why)
    root = worlds.fresh_root()
    try:
        outcome = cw.run_ci_world(world, root)
    finally:
        worlds.remove_root(root)
    assert outcome.broken == [], (world, outcome.code, outcome.broken)


@pytest.mark.parametrize("world", CI, ids=[f"{w.docker}-{w.sockets}-{w.plant}" for w in CI])
def test_ci_system_on_a_hostile_machine(world: cw.CiWorld) -> None:
    _ci_check(world)


@pytest.mark.parametrize("world", [world for world, _before in CI_ONCE_BROKEN],
                         ids=["silent-wait", "forged-line", "raw-escape"])
def test_ci_system_where_it_once_broke(world: cw.CiWorld) -> None:
    _ci_check(world)


_CI_WORLDS = st.builds(cw.CiWorld, st.sampled_from(cw.DOCKERS), st.sampled_from(cw.SOCKETS),
                       st.sampled_from(cw.PLANTS), st.sampled_from(cw.INSTALLED),
                       st.sampled_from(cw.HOSTS), st.booleans())


def test_ci_system_on_generated_hostile_machines() -> None:
    if cw.ci_unavailable() is not None:
        pytest.skip(cw.ci_unavailable() or "")

    @settings(max_examples=max(EXAMPLES // 5, 4), deadline=None, derandomize=not RANDOM,
              database=None, suppress_health_check=list(HealthCheck))
    @given(_CI_WORLDS)
    def one(world: cw.CiWorld) -> None:
        _ci_check(world)

    one()
