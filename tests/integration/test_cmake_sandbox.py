"""Code from a source tree never runs on this host: a guard evaluation runs the tree's CMake in
a throwaway container (`jobs/framework/cmake_sandbox.py`).  Hostile trees, against the real engine:
one that writes a file and runs a program on the host where it is evaluated, one that loops
forever, one that reaches for the network; and the same tree's answers, container and host
alike.  With SM121_CMAKE_ON_HOST=1 (the user's explicit ask) the first one does write its
file, which shows the test can fail."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest

from devkit.helpers import DATA, compile_cached, gencode, one_line_error
from sm121_build.image.engine import READER_LABEL

pytestmark = [pytest.mark.docker]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                          text=True, check=False, timeout=300, env={**os.environ, **env})


def _tree(tmp_path: Path, prologue: str) -> Path:
    """The test's vLLM-like tree with `prologue` run first thing in its cmake/utils.cmake."""
    source = Path(shutil.copytree(DATA / "vllm_like", tmp_path / "src"))
    utils = source / "cmake" / "utils.cmake"
    utils.write_text(prologue + "\n" + utils.read_text())
    return source


def _confined_left() -> list[str]:
    client = docker.from_env()
    return [c.name for c in client.containers.list(all=True, filters={
        "label": f"{READER_LABEL}=confined"})]


def test_a_tree_that_writes_and_runs_on_the_host_is_confined(tmp_path: Path) -> None:
    marker, ran = tmp_path / "written-by-the-tree", tmp_path / "run-by-the-tree"
    source = _tree(tmp_path, f'file(WRITE "{marker}" "pwned")\n'
                             f'execute_process(COMMAND /usr/bin/touch "{ran}")')
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    shutil.copy(compile_cached("exit-sm90", DATA / "kernels.cu", gencode("compute_90:sm_90")),
                package / "_C.abi3.so")  # an extension the audit judges by the tree's guards
    for args in (("patch", str(source), "--version", "0.19.1"),
                 ("patch", str(source), "--explain", "--version", "0.19.1"),
                 ("audit", str(package.parent), "--source", str(source))):
        line = one_line_error(_cli(*args), alone=False)
        # the audit evaluates a copy of the tree's cmake/ (its rules applied), patch the tree
        assert line.startswith("error: cmake -P could not evaluate /"), line
        assert "utils.cmake:1 (file): file failed to open for writing" in line, line
        assert not marker.exists() and not ran.exists()
    assert _confined_left() == []
    asked = _cli("patch", str(source), "--explain", "--version", "0.19.1",
                 SM121_CMAKE_ON_HOST="1")
    assert asked.returncode == 0, asked.stderr
    assert marker.read_text() == "pwned" and ran.exists()  # on the host, as asked


def test_a_tree_that_never_ends_is_stopped_at_the_limit(tmp_path: Path) -> None:
    source = _tree(tmp_path, "while(TRUE)\nendwhile()")
    started = time.monotonic()
    result = _cli("patch", str(source), "--explain", "--version", "0.19.1",
                  SM121_CMAKE_TIMEOUT="3")
    took = time.monotonic() - started
    line = one_line_error(result, alone=True)
    assert line == (f"error: cmake -P of {source / 'cmake' / 'utils.cmake'} gave no result "
                    "within its time limit (a loop in the tree's CMake?): stopped")
    assert took < 60
    assert _confined_left() == []


def test_the_container_has_no_network_no_root_and_no_host_files(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    probe = (f'file(DOWNLOAD "http://172.17.0.1:{port}/x" "/scratch/x" TIMEOUT 3 '
             'STATUS got)\nmessage(STATUS "SM121PROBE|net|${got}")\n'
             'file(READ /proc/self/status me)\nstring(REGEX MATCH "Uid:[^\\n]*" uid "${me}")\n'
             'message(STATUS "SM121PROBE|${uid}")\n'
             f'if(EXISTS "{DATA}")\nmessage(STATUS "SM121PROBE|host files seen")\nendif()\n'
             'message(FATAL_ERROR "SM121PROBE end")')
    try:
        result = _cli("patch", str(_tree(tmp_path, probe)), "--explain", "--version", "0.19.1")
    finally:
        listener.close()
    line = one_line_error(result, alone=True)
    assert "SM121PROBE end" in line
    # what the probe printed is not shown to the user; evaluate it directly instead
    from sm121_build.image.engine import Engine
    from sm121_build.jobs.framework.cmake_sandbox import ContainerCMake
    from sm121_build.source.cmake_run import CMakeScript

    output = ContainerCMake(Engine.connect, 30.0).run(CMakeScript("", probe.rsplit("\n", 1)[0]))
    assert output.status == 0, output.stderr
    said = [x.split("SM121PROBE|", 1)[1] for x in output.stdout.splitlines() if "PROBE|" in x]
    assert said[0].startswith("net|") and not said[0].startswith("net|0;")  # no connection
    assert said[1].split()[1:3] == ["65534", "65534"]  # real and effective uid: nobody
    assert "host files seen" not in said


def test_container_and_host_give_the_same_answers(tmp_path: Path) -> None:
    source = Path(shutil.copytree(DATA / "vllm_like", tmp_path / "src"))
    confined = _cli("patch", str(source), "--explain", "--all-guards", "--version", "0.19.1")
    here = _cli("patch", str(source), "--explain", "--all-guards", "--version", "0.19.1",
                SM121_CMAKE_ON_HOST="1")
    assert confined.returncode == here.returncode == 0, confined.stderr
    assert confined.stdout == here.stdout and "->" in confined.stdout
