"""The nightly workflow's own commands, read from .github/workflows/nightly.yml, run locally
against the end-to-end fixture image (real engine, real nvcc; the vLLM source comes from the
fixture's git repository through SM121_BUILD_REPO instead of GitHub).

The base is pulled from, and the result pushed to, a real registry on loopback (Debian's
docker-registry, devkit/registry.py) standing in for Docker Hub and GHCR.  GitHub itself is
the boundary we cannot reach: the `${{ }}` expressions of the job's `env:` are given the
values GitHub would compute for a scheduled run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
import yaml

from devkit.helpers import ROOT
from devkit.registry import local_registry, push_copy
from devkit.stockimage import StockImage, stock_workspace
from devkit.testtags import RUN

pytestmark = [pytest.mark.docker, pytest.mark.slow]

WORKFLOW = ROOT / ".github" / "workflows" / "nightly.yml"
# What GitHub runs for `shell: bash`.
BASH = ["bash", "--noprofile", "--norc", "-eo", "pipefail"]



def _as_shown(markdown: str) -> str:
    """The summary as GitHub shows it: each value's Markdown escapes (`sm\\_90`, `\\(`)
    read back (the escaper is the text door's; tests/unit/test_run_record.py holds it)."""
    return re.sub(r"\\([\\`*_{}\[\]<>()#+\-.!|~&$])", r"\1", markdown)

def _workflow() -> dict[str, Any]:
    data: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return data


def _step(step_id: str) -> dict[str, Any]:
    (step,) = [s for s in _workflow()["jobs"]["build"]["steps"] if s.get("id") == step_id]
    return dict(step)


@dataclass
class Runner:
    """A stand-in for the self-hosted runner: its temp dir, GITHUB_PATH, the step summary."""

    stock: StockImage
    env: dict[str, str]
    temp: Path
    registry: str

    @property
    def base(self) -> str:
        return self.env["BASE"]

    @property
    def summary(self) -> Path:
        return Path(self.env["GITHUB_STEP_SUMMARY"])

    @property
    def report(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.temp / "sm121-out" / "report.json").read_text())
        return data

    def run_step(self, step_id: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        script = _step(step_id)["run"]
        path = Path(self.env["GITHUB_PATH"])
        added = path.read_text().split() if path.exists() else []
        env = {**self.env, **extra_env}
        env["PATH"] = os.pathsep.join([*reversed(added), env["PATH"]])
        return subprocess.run([*BASH, "-c", script], env=env, capture_output=True, text=True,
                              check=False, cwd=ROOT, stdin=subprocess.DEVNULL)


def _remove(client: docker.DockerClient, tag: str) -> None:
    with contextlib.suppress(docker.errors.ImageNotFound):
        client.images.remove(tag, force=True)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    client, work, stock = stock_workspace(tmp_path_factory, "nightly")
    temp = work / "runner-temp"
    temp.mkdir()
    with local_registry(work) as registry:
        base = f"{registry}/{RUN}/vllm/vllm-openai:nightly"
        push_copy(client, stock.tag, base, work)
        client.images.remove(base)  # the registry has it; the runner must pull it
        env = {
            **os.environ,
            # The job's env: as GitHub evaluates it for a scheduled run.
            "BASE": base, "ARCH": "12.1", "EXTENSIONS": "", "PUSH": "true", "KEEP": "3",
            "FULL_IMAGE": "false", "REGISTRY": registry,
            "KERNELS_TO": f"{registry}/{RUN}/spark/vllm-sm121-kernels",
            "PUSH_TO": f"{registry}/{RUN}/spark/vllm-openai",
            # The runner's own variables.
            "RUNNER_TEMP": str(temp), "GITHUB_PATH": str(work / "github_path"),
            "GITHUB_STEP_SUMMARY": str(work / "summary.md"),
            "DOCKER_CONFIG": str(work / "docker-config"),  # `docker login` writes here
            # Offline: the fixture's git repository stands in for github.com/vllm-project/vllm.
            "SM121_BUILD_REPO": str(stock.checkout),
            "XDG_CACHE_HOME": str(work / "cache"), "XDG_STATE_HOME": str(work / "state"),
            "TMPDIR": str(work / "tmp"),
        }
        yield Runner(stock, env, temp, registry)
        for image in client.images.list():
            for tag in image.tags:
                if tag.startswith(f"{registry}/{RUN}/"):  # this run's, nothing older
                    _remove(client, tag)


@pytest.mark.parametrize("name", ["build", "aot"])
def test_workflow_scripts_read_only_environment_variables(name: str) -> None:
    job = _workflow()["jobs"][name]
    provided = set(job["env"]) | {"RUNNER_TEMP", "GITHUB_PATH", "GITHUB_STEP_SUMMARY"}
    for step in job["steps"]:
        script = step.get("run", "")
        assert "${{" not in script, f"step {step.get('id')}: expression inside run:"
        used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", script))
        assert used <= provided | set(step.get("env", {})), (step.get("id"), used - provided)
    for step in job["steps"]:
        if "uses" in step:
            assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", step["uses"]), step["uses"]


def test_the_nightly_serves_the_spark_on_arm64_and_sm_120_on_amd64() -> None:
    """A (runner, GPU) pair per job: the Spark's build on its own ARM64 runner, as before,
    and an aot-only job per other GPU on a hosted amd64 runner, each publishing its own
    kernels image (the run's --gpu tags it -smXYZ and keys it by GPU)."""
    jobs = _workflow()["jobs"]
    assert jobs["build"]["runs-on"] == ["self-hosted", "linux", "ARM64"]
    assert "--gpu" not in jobs["build"]["steps"][-1].get("run", "")  # the default: sm_121
    pairs = [(m["runner"], m["gpu"]) for m in jobs["aot"]["strategy"]["matrix"]["include"]]
    assert ("ubuntu-24.04", "sm_120") in pairs
    (build,) = [s for s in jobs["aot"]["steps"] if s.get("id") == "build"]
    assert '--gpu "$GPU"' in build["run"] and "--kernels-to" in build["run"]
    assert jobs["aot"]["env"]["GPU"] == "${{ matrix.gpu }}"
    (install,) = [s for s in jobs["aot"]["steps"] if s.get("id") == "install"]
    assert "'.[cuda]'" in install["run"]  # PyPI's ptxas: no CUDA toolkit on a hosted runner


def test_nightly_builds_verifies_and_summarises(runner: Runner) -> None:
    installed = runner.run_step("install")
    assert installed.returncode == 0, installed.stderr
    assert (runner.temp / "sm121-venv" / "bin" / "sm121-build").exists()
    login = runner.run_step("login", REGISTRY_USER="spark", REGISTRY_TOKEN="secret")
    assert login.returncode == 0, login.stderr
    built = runner.run_step("build")
    assert built.returncode == 0, built.stdout + built.stderr
    report = runner.report
    assert report["status"] == "built" and report["error"] is None
    assert report["tag"] == f"{runner.base}-sm121"
    assert report["pulled"]["before"] is None  # the runner had no copy: pulled
    assert report["tags"][0] == report["tag"]
    assert report["tags"][1].startswith(f"{runner.base}-sm121-0.19.1-{runner.stock.commit[:12]}-b")
    assert report["vllm_commit"] == runner.stock.commit
    for name in ("_C.abi3.so", "_moe_C.abi3.so"):
        assert set(report["before"][name]["cubins"]) == {"sm_90"}
        assert report["before"][name]["kernels"]["native"] == 0
        # _C also carries the FP4 kernel as sm_121a (its guard rewritten to 12.1a)
        assert set(report["after"][name]["cubins"]) == (
            {"sm_121", "sm_121a"} if name == "_C.abi3.so" else {"sm_121"})
        assert report["after"][name]["kernels"]["native"] > 0
    # published by default: the kernels image, by the run itself, after verification
    kernels = runner.env["KERNELS_TO"]
    assert report["kernels_to"] == [
        report["kernels_to"][0], f"{kernels}:0.19.1-{runner.stock.commit[:12]}-cu130-sm121",
        f"{kernels}:nightly"]
    assert _registry_tags(runner, f"{RUN}/spark/vllm-sm121-kernels") == sorted(
        tag.rsplit(":", 1)[1] for tag in report["kernels_to"])
    # the full image only when asked
    assert _registry_tags(runner, f"{RUN}/spark/vllm-openai") == []
    out = runner.temp / "sm121-out"
    assert (out / "artifacts" / "manifest.json").exists()
    assert "tagged " in (out / "console.log").read_text()
    # as GitHub shows it: each value's Markdown escapes (`sm\_90`, `\-`) read back
    summary = _as_shown(runner.summary.read_text())
    assert summary.startswith(f"## sm121-build: `{runner.base}` → `{report['tag']}`")
    assert "**built and verified**" in summary
    plan_row = next(line for line in summary.splitlines() if line.startswith("| `_C.abi3.so`"))
    assert plan_row.startswith("| `_C.abi3.so` | yes | 0 → ")  # the per-extension plan
    c_row = next(line for line in summary.splitlines()
                 if line.startswith("| `_C.abi3.so` | sm_"))
    before, after = report["before"]["_C.abi3.so"], report["after"]["_C.abi3.so"]
    assert c_row.startswith(f"| `_C.abi3.so` | sm_90 ×{before['cubins']['sm_90']} | 0 native")
    assert (f"sm_121 ×{after['cubins']['sm_121']}, sm_121a ×{after['cubins']['sm_121a']} | "
            f"{after['kernels']['native']} native" in c_row)

    # the proof step proves the tag the run made; this machine's engine has no NVIDIA
    # Container Toolkit, so it refuses in one line, and the step fails visibly
    proved = runner.run_step("prove")
    assert proved.returncode == 2, proved.stdout + proved.stderr
    assert "error: the Docker engine cannot give a container the GPU" in proved.stdout
    assert f"inspect {report['tag']}" in proved.stdout
    assert not (out / "proof.json").exists()

    again = runner.run_step("build")
    assert again.returncode == 0, again.stderr
    assert runner.report["status"] == "up-to-date"
    assert runner.report["pulled"]["before"] == runner.report["pulled"]["after"]
    assert runner.report["after"] == report["after"]  # the audit of the image it found
    # each run appends its plan row and its audit row (the up-to-date run the recalled one)
    assert _as_shown(runner.summary.read_text()).count("| `_C.abi3.so`") == 4
    assert "**up to date (build skipped)**" in _as_shown(runner.summary.read_text())
    assert f"- kernels pushed: `{kernels}:nightly`" in _as_shown(runner.summary.read_text())


def test_failed_build_reports_and_pushes_nothing(runner: Runner) -> None:
    failed = runner.run_step("build", EXTENSIONS="_nope_C")  # a target the source lacks
    assert failed.returncode == 2
    report = runner.report
    assert report["status"] == "failed"
    assert report["error"].startswith("the pinned source defines no CMake target for "
                                      "_nope_C.abi3.so")
    assert "**FAILED**: the pinned source defines no CMake target" in \
        _as_shown(runner.summary.read_text())
    refused = runner.run_step("build", ARCH="9.0")  # refused before any work
    assert refused.returncode == 2
    assert "'9.0' gives sm_121 no native code" in refused.stdout + refused.stderr
    # The workflow's full-image push runs only after a successful build step, when asked.
    assert _step("push")["if"] == ("steps.build.outcome == 'success' && "
                                   "env.FULL_IMAGE == 'true'")


def test_push_and_prune_steps_against_a_real_registry(runner: Runner) -> None:
    runner.run_step("build")  # up to date again: the report names the verified image's tags
    assert runner.report["status"] == "up-to-date"
    pushed = runner.run_step("push", FULL_IMAGE="true")  # asked for (workflow input)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    suffixes = [tag.rsplit(":", 1)[1] for tag in runner.report["tags"]]
    assert _registry_tags(runner, f"{RUN}/spark/vllm-openai") == sorted(suffixes)
    summary = _as_shown(runner.summary.read_text())
    for suffix in suffixes:
        assert f"pushed `{runner.env['PUSH_TO']}:{suffix}`" in summary
    assert _step("prune")["if"] == "always() && steps.install.outcome == 'success'"
    pruned = runner.run_step("prune", KEEP="1")
    assert pruned.returncode == 0, pruned.stderr
    assert "removed 0 image(s)" in pruned.stdout  # one build only: the newest stays
    assert docker.from_env().images.get(runner.report["tag"])
    logout = runner.run_step("logout")
    assert logout.returncode == 0, logout.stderr
    config = json.loads((Path(runner.env["DOCKER_CONFIG"]) / "config.json").read_text())
    assert runner.registry not in config.get("auths", {})


def _registry_tags(runner: Runner, repository: str) -> list[str]:
    """The tags the registry lists for a repository ([] when it has none)."""
    try:
        with urllib.request.urlopen(f"http://{runner.registry}/v2/{repository}/tags/list",
                                    timeout=10) as response:
            return sorted(json.load(response).get("tags") or [])
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise
