from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from devkit.helpers import DATA, compile_cached, gencode, link_cached
from sm121_build.source.cmake_run import HostCMake, evaluating_with
from sm121_build.source.guards import find_cmake

# Each build is one .so; nvcc refuses sm_120 and sm_120f in one fatbin, hence several.
MATRIX: dict[str, list[str]] = {
    "plain": [
        *gencode("compute_80:sm_80", "compute_90a:sm_90a", "compute_100a:sm_100a",
                 "compute_120:sm_120", "compute_120a:sm_120a", "compute_121:sm_121",
                 "compute_121a:sm_121a", "compute_120:compute_120", "compute_90:compute_90"),
        "--compress-mode=none",
    ],
    "family": gencode("compute_120f:sm_120f", "compute_100f:sm_100f",
                      "compute_120f:compute_120f"),
    "ptx_only": gencode("compute_80:compute_80", "compute_90a:compute_90a",
                        "compute_121a:compute_121a", "compute_100f:compute_100f"),
    "lz4": [*gencode("compute_90:sm_90", "compute_90:compute_90", "compute_121:sm_121"),
            "--compress-mode=speed"],
    "zstd": [*gencode("compute_90:sm_90", "compute_90:compute_90", "compute_121a:sm_121a"),
             "--compress-mode=size"],
    "sm121": gencode("compute_121:sm_121"),
    "sm90": [*gencode("compute_90:sm_90"), "--compress-mode=none"],
}


_SESSION_STATE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """No test, and no fixture of a wider scope than a test, writes the tool's state (the
    ledger, logs) into the real home: a session-wide state dir first, each test its own."""
    import os
    import tempfile

    _SESSION_STATE.append(tempfile.mkdtemp(prefix="sm121-test-state-"))
    os.environ["XDG_STATE_HOME"] = _SESSION_STATE[-1]
    # the engine the tests marked docker use: DOCKER_HOST as the session began ("" for the
    # default socket), kept where xdist's workers, started after this, inherit it
    os.environ.setdefault(ENGINE_HOST, os.environ.get("DOCKER_HOST", ""))


ROOT = Path(__file__).resolve().parent.parent
ENGINE = "the engine's tests"
ENGINE_HOST = "SM121_TESTS_DOCKER_HOST"  # the engine of the tests marked docker


@functools.cache
def _engine_file(path: str) -> bool:
    """Whether the test file at `path` (from the repository root) marks any test `docker`."""
    file = ROOT / path
    return file.suffix == ".py" and "pytest.mark.docker" in file.read_text()


class EngineApart(LoadScopeScheduling):  # type: ignore[misc]
    """pytest-xdist's scheduling by scope, the scope of a test being ENGINE when its file
    marks a test `docker`, else the test itself: the engine's tests one unit, run in order
    on one worker and dealt first (the largest unit: xdist deals them by size), every other
    test a unit of its own, spread over the workers."""

    def _split_scope(self, nodeid: str) -> str:
        return ENGINE if _engine_file(nodeid.split("::", 1)[0]) else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (`-n auto`, pyproject's addopts) the suite is scheduled by
    EngineApart: the engine's tests count what the engine holds and share the session's
    images, each built once.  (xdist's `--dist loadgroup` groups by a node ID suffix that
    pytest 9 no longer keeps.)"""
    return EngineApart(config, log)


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test marked `docker` is in a file the scheduler puts in the engine's unit (one that
    spells `pytest.mark.docker`): else it would run beside the engine's tests."""
    if item.get_closest_marker("docker") and not _engine_file(item.nodeid.split("::", 1)[0]):
        raise pytest.UsageError(f"{item.nodeid} is marked docker in a file that does not "
                                "spell pytest.mark.docker: the scheduler cannot see it")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The images this run made in a Docker engine go with it (every one is named under its
    own prefix, devkit/testtags.py); another run's, a user's and the suite's cache stay."""
    from devkit.testtags import engine_used, remove_this_runs

    if engine_used:
        import os

        import docker

        engine = os.environ.get(ENGINE_HOST, "")
        remove_this_runs(docker.from_env(timeout=900, environment={
            **{k: v for k, v in os.environ.items() if k != "DOCKER_HOST"},
            **({"DOCKER_HOST": engine} if engine else {})}))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's state dir goes with the session: no test leaves one in the temp folder."""
    import shutil

    for folder in _SESSION_STATE:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test keeps its ledger and logs in its own state dir, never the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(autouse=True)
def _cmake_on_this_host(request: pytest.FixtureRequest,
                        monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests without an engine evaluate their own test trees' CMake on this host, as
    SM121_CMAKE_ON_HOST=1 asks; tests marked `docker` take the default path, the throwaway
    container (tests/integration/test_cmake_sandbox.py tries it with hostile trees)."""
    if request.node.get_closest_marker("docker"):
        monkeypatch.delenv("SM121_CMAKE_ON_HOST", raising=False)
        yield
        return
    monkeypatch.setenv("SM121_CMAKE_ON_HOST", "1")
    with evaluating_with(HostCMake(find_cmake, 60.0)):
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test not marked `docker` has no engine to reach: DOCKER_HOST names a socket that is
    not there (a test of its own fake engine sets its own); a test marked `docker` has the
    session's engine.  Set before any fixture of the test is made, those of its module and
    the session too (a fixture of the test's own scope is made after them: a module's
    fixture of an unmarked test reached the engine).  So the engine's tests, one at a time
    on one xdist worker, are the only ones that touch it while they count what it holds; a
    test that reaches the engine unmarked fails here, not by chance there."""
    import os

    engine = os.environ.get(ENGINE_HOST, "")
    if not item.get_closest_marker("docker"):
        engine = f"unix://{_SESSION_STATE[-1]}/no-engine.sock"
    else:
        _hold_the_engine(engine)
    if engine:
        os.environ["DOCKER_HOST"] = engine
    else:
        os.environ.pop("DOCKER_HOST", None)


_ENGINE_HELD: list[int] = []  # the lock's descriptor, kept open while this process runs


def _hold_the_engine(engine: str) -> None:
    """Before this process's first test of the engine: an exclusive lock, for the rest of
    the process, on a file of this host named by the engine (DOCKER_HOST), so that two test
    runs sharing one engine (a self-hosted runner's nightly and PR jobs; a rehearsal beside
    a comparison) take turns.  Their tests count what the engine holds (no image or
    container left, the result the only new image): another run's images and containers,
    made or removed meanwhile, failed them.  Waiting is said once."""
    import fcntl
    import hashlib
    import os
    import sys

    if _ENGINE_HELD:
        return
    key = hashlib.sha256((engine or "unix:///var/run/docker.sock").encode()).hexdigest()
    path = Path("/tmp") / f"sm121-test-engine-{key[:16]}.lock"
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.stderr.write(f"\nwaiting for another test run's engine tests ({path})\n")
        fcntl.flock(descriptor, fcntl.LOCK_EX)
    _ENGINE_HELD.append(descriptor)


@pytest.fixture(scope="session")
def matrix() -> dict[str, Path]:
    built = {name: compile_cached(name, DATA / "kernels.cu", flags)
             for name, flags in MATRIX.items()}
    built["reloc"] = compile_cached("reloc", DATA / "kernels.cu",
                                    [*gencode("compute_90:sm_90", "compute_90:compute_90"),
                                     "-rdc=true"], shared=False)
    return built


@pytest.fixture(scope="session")
def plain_so(matrix: dict[str, Path]) -> Path:
    return matrix["plain"]


@pytest.fixture(scope="session")
def host_only_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ELF .so with no device code (gcc)."""
    import subprocess

    src = tmp_path_factory.mktemp("host") / "host.c"
    src.write_text("int answer(void) { return 42; }\n")
    out = src.with_suffix(".so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture()
def fa2_add_rule(tmp_path_factory: pytest.TempPathFactory,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The rule set with FA2's former add rule (tests/data/rules) in place of sass-from-ptx:
    the add-rule machinery keeps its tests.  The rule cache is cleared on both sides."""
    import shutil

    from sm121_build.source import guard_rules as patch

    folder = tmp_path_factory.mktemp("rules")
    shutil.copy2(patch.patches_dir() / "fp4-sm12x-arch-specific.yaml", folder)
    shutil.copy2(DATA / "rules" / "fa2-sm12x-native.yaml", folder)
    patch._load_all.cache_clear()
    monkeypatch.setattr(patch, "patches_dir", lambda: folder)
    yield folder
    patch._load_all.cache_clear()


@pytest.fixture(scope="session")
def jit_only_so() -> Path:
    """Two translation units: each an sm_80 cubin and compute_80 PTX (FA2's shape), one
    with ptxas options recorded in its PTX entry: JIT-only on sm_121, what aot compiles."""
    sm80_ptx = gencode("compute_80:compute_80", "compute_80:sm_80")
    return link_cached("aot_two", [
        (DATA / "two_tus" / "a.cu", sm80_ptx),
        (DATA / "two_tus" / "b.cu", [*sm80_ptx, "-Xptxas", "--maxrregcount=32"]),
    ])


@pytest.fixture(scope="session")
def fa2_names_so() -> Path:
    """Kernels named as vLLM FA2's (empty bodies) in two translation units, so two modules,
    each an sm_80 cubin and compute_80 PTX: aot'd, `prove` derives cases of both modules
    from their names and deals them to two parts (tests/data/fa2_names)."""
    sm80_ptx = gencode("compute_80:compute_80", "compute_80:sm_80")
    return link_cached("fa2_names", [
        (DATA / "fa2_names" / "fwd.cu", sm80_ptx),
        (DATA / "fa2_names" / "splitkv.cu", sm80_ptx),
    ])


@pytest.fixture(scope="session")
def marlin_names_so() -> Path:
    """Kernels named as vLLM 0.22.0's Marlin GEMM kernels (empty bodies) in two translation
    units (GPTQ with half activations, AWQ with int8 ones), each an sm_80 cubin and
    compute_80 PTX: aot'd as `_C.abi3.so`, `prove` derives marlin_gemm cases from their
    names and deals them to two parts (tests/data/marlin_names)."""
    sm80_ptx = gencode("compute_80:compute_80", "compute_80:sm_80")
    return link_cached("marlin_names", [
        (DATA / "marlin_names" / "gptq_f16.cu", sm80_ptx),
        (DATA / "marlin_names" / "awq_s8.cu", sm80_ptx),
    ])
