"""End to end with a real engine: stock-like image -> sm121-build -> tagged, verified image.

The stock image (devkit/stockimage.py) is made locally: Debian, nvcc 13.0, a vLLM-shaped
package with sm_90-only extensions.  Every build below is real: BuildKit (or the legacy
builder), nvcc and ptxas inside the builder stage.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import jsonschema
import pytest

from devkit.fake_gpu import fake_python
from devkit.helpers import DATA, ROOT, compile_cached, compile_device_file, gencode, one_line_error
from devkit.keys import key_pair
from devkit.registry import local_registry
from devkit.silent import silent_listener
from devkit.stallproxy import stalling
from devkit.stockimage import TORCH_VERSION, StockImage, stock_workspace
from devkit.testtags import RUN, remove_this_runs
from sm121_build.core.compile_progress import CompileProgress
from sm121_build.core.shipped import schema
from sm121_build.cuda.binary import Policy, audit_binary
from sm121_build.cuda.compat import parse_target
from sm121_build.image.api import PIN_REPO

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PREFIX = f"{RUN}/e2e"
INJECTED = ("_C.abi3.so", "_moe_C.abi3.so")
SCOPE = ("--only", "_C", "--only", "_moe_C")


@dataclass
class E2E:
    client: docker.DockerClient
    stock: StockImage
    env: dict[str, str]
    work: Path

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sm121_build", *args], capture_output=True,
                              text=True, check=False, env=self.env)

    def build(self, tag: str, *extra: str, scope: tuple[str, ...] = SCOPE
              ) -> subprocess.CompletedProcess[str]:
        """The main job on the stock image; by default restricted to _C/_moe_C (`--only`),
        which most tests are about; `scope=()` is the default run (every extension that
        gains: the fixture's FA2 too)."""
        return self.run("--base", self.stock.tag, "--source", str(self.stock.checkout),
                        "--tag", tag, *scope, *extra)

    def exists(self, tag: str) -> bool:
        try:
            self.client.images.get(tag)
        except docker.errors.ImageNotFound:
            return False
        return True


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    """The module's engine and stock image; at its end the images it made (under PREFIX,
    this run's alone) and the pins on them go, nothing of another run's."""
    client, work, stock = stock_workspace(tmp_path_factory, "e2e")
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "TMPDIR": str(work / "tmp")}
    yield E2E(client, stock, env, work)
    remove_this_runs(client, under="e2e")


@pytest.fixture(scope="module")
def patched(e2e: E2E) -> subprocess.CompletedProcess[str]:
    return e2e.build(f"{PREFIX}:patched", "--out", str(e2e.work / "artifacts"))


def _flat_files(client: docker.DockerClient, image: str) -> dict[str, tuple[str, int, str]]:
    """The engine's own view of an image's filesystem (`docker create` + `docker export`,
    no start): path -> (kind, mode, sha256 of content or link target).  Independent of the
    tool's layer reader."""
    container = client.containers.create(image, command=["true"])
    try:
        stream = io.BytesIO(b"".join(container.export()))
    finally:
        container.remove(force=True)
    files: dict[str, tuple[str, int, str]] = {}
    with tarfile.open(fileobj=stream) as tar:
        for member in tar:
            if member.isdir():
                continue
            if member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None
                files[member.name] = ("file", member.mode,
                                      hashlib.sha256(handle.read()).hexdigest())
            else:
                files[member.name] = ("link", member.mode, member.linkname)
    return files


def _changed_files(e2e: E2E, tag: str) -> set[str]:
    """The files of `tag` that differ from the stock image's, by their path under the
    package (the engine's own view: `_flat_files`)."""
    before = _flat_files(e2e.client, e2e.stock.tag)
    after = _flat_files(e2e.client, tag)
    package = e2e.stock.package_dir.lstrip("/") + "/"
    return {path.removeprefix(package) for path in before.keys() | after.keys()
            if before.get(path) != after.get(path)}


def test_unpatched_build_fails_with_ptxas_message_and_tags_nothing(e2e: E2E) -> None:
    result = e2e.build(f"{PREFIX}:unpatched", "--no-patch")
    assert result.returncode == 5, result.stderr  # BuildFailed
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: docker build failed: build failed: ptxas rejected an FP4 "
                            "instruction for the plain target sm_121")
    assert "Instruction 'cvt with .e2m1x2' not supported on .target 'sm_121'" in error
    assert "full log: " in error
    log = Path(error.rsplit("full log: ", 1)[1])
    assert "e2m1x2" in log.read_text()
    assert not e2e.exists(f"{PREFIX}:unpatched")


def test_patched_build_is_tagged_with_sm121_kernels_and_labels(e2e: E2E, patched: subprocess.
                                                               CompletedProcess[str]) -> None:
    assert patched.returncode == 0, patched.stderr
    assert f"tagged {PREFIX}:patched" in patched.stdout
    # the compile step's progress from the real BuildKit stream: plain lines (no terminal),
    # and every ninja line of the real log is read as a step
    assert "    compiling [" in patched.stderr, patched.stderr[-3000:]
    log = Path(patched.stdout.split("(log: ", 1)[1].split(")", 1)[0])
    progress = CompileProgress()
    for number, line in enumerate(log.read_text(errors="replace").splitlines()):
        progress.feed(line, float(number))
    assert progress.phases and all(p.done <= p.total for p in progress.phases)
    assert progress.phases[-1].total > 1
    assert "fp4-sm12x-arch-specific: applied" in patched.stderr
    image = e2e.client.images.get(f"{PREFIX}:patched")
    labels = image.labels
    stock = e2e.client.images.get(e2e.stock.tag)
    assert labels["io.github.sm121-build.vllm.version"] == "0.19.1"
    assert labels["io.github.sm121-build.vllm.commit"] == e2e.stock.commit
    assert labels["io.github.sm121-build.arch-list"] == "12.1"
    assert labels["io.github.sm121-build.extensions"] == ",".join(INJECTED)
    assert labels["org.opencontainers.image.base.digest"] == stock.id
    assert len(labels["io.github.sm121-build.patches"]) == 16
    audit = e2e.run("audit", "--json", "--include", "*/vllm/_*.so", f"{PREFIX}:patched")
    verdicts = {Path(b["name"]).name: b["verdict"] for b in json.loads(audit.stdout)["binaries"]}
    assert verdicts == {"_C.abi3.so": "native", "_moe_C.abi3.so": "native"}
    stock_audit = e2e.run("audit", "--json", "--include", "*/vllm/_*.so", e2e.stock.tag)
    assert {b["verdict"] for b in json.loads(stock_audit.stdout)["binaries"]} == {"none"}


def test_every_other_file_is_byte_identical_to_stock(e2e: E2E, patched: subprocess.
                                                     CompletedProcess[str]) -> None:
    assert patched.returncode == 0, patched.stderr
    assert _changed_files(e2e, f"{PREFIX}:patched") == set(INJECTED)
    assert len(_flat_files(e2e.client, e2e.stock.tag)) > 1000  # the whole root was compared


def test_exported_artifacts_match_the_image(e2e: E2E, patched: subprocess.
                                            CompletedProcess[str]) -> None:
    assert patched.returncode == 0, patched.stderr
    manifest = json.loads((e2e.work / "artifacts" / "manifest.json").read_text())
    assert manifest["vllm_commit"] == e2e.stock.commit
    assert manifest["base_digest"] == e2e.client.images.get(e2e.stock.tag).id
    assert manifest["torch_version"] == TORCH_VERSION  # read from the image's torch/version.py
    image = _flat_files(e2e.client, f"{PREFIX}:patched")
    package = e2e.stock.package_dir.lstrip("/")
    policy = Policy(parse_target("sm_121"), (13, 0))
    for name in INJECTED:
        assert manifest["files"][name]["sha256"] == image[f"{package}/{name}"][2]
        report = audit_binary(e2e.work / "artifacts" / name, name, policy, True)
        assert manifest["files"][name]["kernels_native"] == report.kernel_counts()["native"]
        # _C carries the FP4 kernel as sm_121a (the rule rewrote its guard to 12.1a)
        assert set(manifest["files"][name]["cubins"]) == (
            {"sm_121", "sm_121a"} if name == "_C.abi3.so" else {"sm_121"})


def test_second_run_skips(e2e: E2E, patched: subprocess.CompletedProcess[str]) -> None:
    assert patched.returncode == 0, patched.stderr
    again = e2e.build(f"{PREFIX}:patched")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"up to date: {PREFIX}:patched (content key ")
    assert "==> build" not in again.stderr
    other_tag = e2e.build(f"{PREFIX}:same-content")
    assert other_tag.stdout.startswith(f"up to date: {PREFIX}:same-content")
    assert (e2e.client.images.get(f"{PREFIX}:same-content").id ==
            e2e.client.images.get(f"{PREFIX}:patched").id)


def test_inject_artifacts_gives_the_same_bytes(e2e: E2E, patched: subprocess.
                                               CompletedProcess[str]) -> None:
    assert patched.returncode == 0, patched.stderr
    report = e2e.work / "inject-report.json"
    result = e2e.run("inject", "--artifacts", str(e2e.work / "artifacts"), "--base",
                     e2e.stock.tag, "--tag", f"{PREFIX}:injected", "--report", str(report),
                     "--json")
    assert result.returncode == 0, result.stderr
    assert "==> build" not in result.stderr  # no compile step
    recorded = json.loads(report.read_text())
    assert json.loads(result.stdout) == recorded  # --json: the record on stdout, alone
    assert f"tagged {PREFIX}:injected" in result.stderr
    assert "\nsummary: injected\n  steps: " in result.stderr
    assert [s["ok"] for s in recorded["steps"]] == [True] * len(recorded["steps"])
    assert (recorded["status"], recorded["vllm_commit"]) == ("injected", e2e.stock.commit)
    assert set(recorded["after"]["_C.abi3.so"]["cubins"]) == {"sm_121", "sm_121a"}
    built = _flat_files(e2e.client, f"{PREFIX}:patched")
    injected = _flat_files(e2e.client, f"{PREFIX}:injected")
    assert built == injected


def test_kernels_image_published_and_injected_from_a_registry(
        e2e: E2E, patched: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    """Build once, inject everywhere: the verified artifacts as a kernels image in a real
    registry on loopback, pulled back (by digest) by another machine's `inject --from`,
    verified, and the same bytes as the local build; an image holding what it does not
    declare, or a file whose sha256 differs, is refused."""
    assert patched.returncode == 0, patched.stderr
    artifacts = e2e.work / "artifacts"
    manifest = json.loads((artifacts / "manifest.json").read_text())
    package = manifest["package_dir"].strip("/")
    with local_registry(tmp_path) as registry:
        try:
            _kernels_round_trip(e2e, tmp_path, registry, artifacts, manifest, package)
            _kernels_to_and_reuse(e2e, tmp_path, registry)
            _kernels_refused_or_unreachable(e2e, tmp_path, registry, artifacts, package)
            _ctrl_c_during_the_kernels_pull(e2e, registry)
        finally:  # what the test pushed and pulled back leaves the engine with it
            for image in e2e.client.images.list():
                for tag in image.tags:
                    if tag.startswith(f"{registry}/{RUN}/"):
                        e2e.client.images.remove(tag, force=True)


def _kernels_round_trip(e2e: E2E, tmp_path: Path, registry: str, artifacts: Path,
                        manifest: dict[str, Any], package: str) -> None:
    repo = f"{registry}/{RUN}/kernels"
    published = e2e.run("kernels", "publish", "--artifacts", str(artifacts), "--to", repo,
                        "--tag", "nightly")
    assert published.returncode == 0, published.stderr
    tags = published.stdout.split()
    assert len(tags) == 3 and tags[0].startswith(f"{repo}:k-")
    assert tags[1] == f"{repo}:0.19.1-{e2e.stock.commit[:12]}-cu130-sm121"
    assert tags[2] == f"{repo}:nightly"
    engine_made = {".dockerenv", "dev/console", "etc/hostname", "etc/hosts", "etc/mtab",
                   "etc/resolv.conf"}  # what every created container shows
    assert set(_flat_files(e2e.client, tags[0])) - engine_made == {
        *(f"{package}/{name}" for name in manifest["files"]), "sm121-build/manifest.json"}
    labels = e2e.client.images.get(tags[0]).labels
    assert tags[0].endswith(f":k-{labels['io.github.sm121-build.reuse-key']}")
    assert labels["io.github.sm121-build.kind"] == "kernels"
    assert labels["io.github.sm121-build.vllm.commit"] == manifest["vllm_commit"]
    for tag in tags:
        e2e.client.images.remove(tag)
    images = {i.id for i in e2e.client.images.list(all=True)}
    result = e2e.run("inject", "--from", tags[1], "--base", e2e.stock.tag, "--tag",
                     f"{PREFIX}:from-registry", "--report", str(tmp_path / "from.json"))
    assert result.returncode == 0, result.stderr
    assert f"==> kernels {tags[1]}" in result.stderr and "==> verify" in result.stderr
    pulled = json.loads((tmp_path / "from.json").read_text())["kernels_from"]
    assert pulled["outcome"] == "hit" and pulled["digest"].startswith("sha256:")
    assert f"{tags[1]} is {pulled['digest']} (reuse key {tags[0].rsplit(':k-', 1)[1]})" in \
        result.stderr  # pulled by the digest the tag resolved to
    assert "\n    pulled " in result.stderr  # what the pull brought, and how fast
    # the kernels image was read and removed again: nothing of the repository is left, and
    # the result is the only image that can be new (the build cache may give an existing ID)
    assert {i.id for i in e2e.client.images.list(all=True)} - images <= {
        e2e.client.images.get(f"{PREFIX}:from-registry").id}
    assert not [i.id for i in e2e.client.images.list(all=True)
                if any(d.startswith(f"{repo}@") for d in i.attrs.get("RepoDigests") or ())]
    assert _flat_files(e2e.client, f"{PREFIX}:from-registry") == \
        _flat_files(e2e.client, f"{PREFIX}:patched")
    # the main job looks the build up by the base's own facts: a hit injects, no compile
    via = e2e.run("--base", e2e.stock.tag, "--kernels-from", repo, "--tag",
                  f"{PREFIX}:via-lookup", "--report", str(tmp_path / "via.json"))
    assert via.returncode == 0, via.stderr
    assert f"==> kernels {tags[1]}" in via.stderr and "reuse key" in via.stderr
    assert "==> build" not in via.stderr and "==> verify" in via.stderr
    assert json.loads((tmp_path / "via.json").read_text())["status"] == "injected"
    assert _flat_files(e2e.client, f"{PREFIX}:via-lookup") == \
        _flat_files(e2e.client, f"{PREFIX}:patched")
    miss = e2e.run("--base", e2e.stock.tag, "--kernels-from", f"{registry}/{RUN}/none",
                   "--no-build", "--tag", f"{PREFIX}:no-build")
    assert miss.returncode == 2, miss.stderr
    assert miss.stderr.strip().splitlines()[-1].startswith(
        f"error: no kernels image for {e2e.stock.tag} in {registry}/{RUN}/none "
        "(not in the registry; --no-build)")
    assert not e2e.exists(f"{PREFIX}:no-build")
    for what, change in (("extra", "undeclared"), ("sha", "sha256")):
        bad = _tampered_kernels(e2e, tmp_path / what, artifacts, package, what)
        remote = f"{repo}:{what}"
        e2e.client.images.get(bad).tag(remote)
        e2e.client.images.push(remote)
        e2e.client.images.remove(remote)
        refused = e2e.run("inject", "--from", remote, "--base", e2e.stock.tag, "--tag",
                          f"{PREFIX}:refused-{what}")
        assert refused.returncode == 2, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith("error: ") and (
            "which its manifest does not declare" in line if change == "undeclared"
            else "sha256 differs from the manifest" in line), line
        assert not e2e.exists(f"{PREFIX}:refused-{what}")


def _kernels_to_and_reuse(e2e: E2E, tmp_path: Path, registry: str) -> None:
    """The main job publishes what it verified (`--kernels-to`, here on an up-to-date run:
    the verified files are exported and pushed), and another base with the same vLLM and
    torch (a local re-build of the stock image: another image ID) finds them, on a machine
    with a fresh cache and state."""
    repo = f"{registry}/{RUN}/published"
    signing, trusted = key_pair(tmp_path, "ours")
    _other, untrusted = key_pair(tmp_path, "theirs")
    done = e2e.build(f"{PREFIX}:patched", "--kernels-to", repo, "--sign-key", str(signing),
                     "--report", str(tmp_path / "to.json"))
    assert done.returncode == 0, done.stderr
    assert f"signed {repo}@sha256:" in done.stderr and "provenance attached: " in done.stderr
    pinned = f"{repo}:0.19.1-{e2e.stock.commit[:12]}-cu130-sm121"
    vouched = e2e.run("kernels", "verify", pinned, "--trust-key", str(trusted))
    assert vouched.returncode == 0, vouched.stderr
    provenance = json.loads(vouched.stdout)
    assert provenance["manifest"]["vllm_commit"] == e2e.stock.commit
    assert provenance["manifest"]["base_digest"] and provenance["run"]["content_key"]
    denied = e2e.run("kernels", "verify", pinned, "--trust-key", str(untrusted))
    assert denied.returncode == 3, denied.stderr
    assert denied.stderr.strip().startswith("error: no signature of ")
    record = json.loads((tmp_path / "to.json").read_text())
    assert record["status"] == "up-to-date" and "artifacts" not in record  # no --out asked
    moving = e2e.stock.tag.rsplit(":", 1)[1]
    assert record["kernels_to"][1:] == [
        f"{repo}:0.19.1-{e2e.stock.commit[:12]}-cu130-sm121", f"{repo}:{moving}"]
    assert f"==> publish kernels to {repo}" in done.stderr
    # the local tags the push needed are in the ledger the run wrote: `prune` knows them
    book = Path(e2e.env["XDG_STATE_HOME"]) / "sm121-build" / "ledger.json"
    listed = {t for entry in json.loads(book.read_text())["built"] for t in entry["tags"]}
    assert set(record["kernels_to"]) <= listed
    with urllib.request.urlopen(f"http://{registry}/v2/{RUN}/published/tags/list",
                                timeout=10) as response:
        listed_tags = json.load(response)["tags"]
    assert sorted(t for t in listed_tags if not t.endswith((".sig", ".att"))) == sorted(
        t.rsplit(":", 1)[1] for t in record["kernels_to"])
    assert sorted(t.rsplit(".", 1)[1] for t in listed_tags if t.startswith("sha256-")) == \
        ["att", "sig"]  # one signature and one attestation, beside the one image
    other = e2e.work / "other-base"
    other.mkdir(exist_ok=True)
    (other / "Dockerfile").write_text(f"FROM {e2e.stock.tag}\nLABEL sm121.test.rebuilt=1\n")
    image, _ = e2e.client.images.build(path=str(other), rm=True, tag=f"{PREFIX}:other-base")
    assert image.id != e2e.client.images.get(e2e.stock.tag).id
    fresh = {**e2e.env, "XDG_CACHE_HOME": str(tmp_path / "fresh-cache"),  # another machine:
             "XDG_STATE_HOME": str(tmp_path / "fresh-state")}  # no facts, ledger or logs yet
    refused = subprocess.run(  # signed, but not by the key this machine trusts
        [sys.executable, "-m", "sm121_build", "--base", f"{PREFIX}:other-base",
         "--kernels-from", repo, "--no-build", "--tag", f"{PREFIX}:other-base-sm121"],
        capture_output=True, text=True, check=False,
        env={**fresh, "SM121_TRUST_KEY": str(untrusted)})
    assert refused.returncode == 2, refused.stderr
    assert f"verifies with {untrusted}: not used" in refused.stderr
    assert not e2e.exists(f"{PREFIX}:other-base-sm121")
    hit = subprocess.run(
        [sys.executable, "-m", "sm121_build", "--base", f"{PREFIX}:other-base",
         "--kernels-from", repo, "--no-build", "--tag", f"{PREFIX}:other-base-sm121",
         "--trust-key", str(trusted), "--report", str(tmp_path / "re.json")],
        capture_output=True, text=True, check=False, env=fresh)
    assert hit.returncode == 0, hit.stderr
    used = json.loads((tmp_path / "re.json").read_text())["kernels_from"]
    assert used["outcome"] == "hit"
    assert record["kernels_to"][0] == f"{repo}:k-{used['reuse_key']}"  # the key that matched
    assert "==> build" not in hit.stderr and e2e.exists(f"{PREFIX}:other-base-sm121")


def _kernels_refused_or_unreachable(e2e: E2E, tmp_path: Path, registry: str,
                                    artifacts: Path, package: str) -> None:
    """Kernels built against another torch are not used (one line) and the run builds
    instead (here: up to date, the content key unchanged); a registry that is down is one
    line too, and the run still builds; with --no-build either one fails."""
    repo = f"{registry}/{RUN}/other-torch"
    pinned = f"0.19.1-{e2e.stock.commit[:12]}-cu130-sm121"
    torch = _tampered_kernels(e2e, tmp_path / "torch", artifacts, package, "torch")
    e2e.client.images.get(torch).tag(f"{repo}:{pinned}")
    e2e.client.images.push(f"{repo}:{pinned}")
    e2e.client.images.remove(f"{repo}:{pinned}")
    refused = e2e.build(f"{PREFIX}:patched", "--kernels-from", repo, "--report",
                        str(tmp_path / "torch.json"))
    assert refused.returncode == 0, refused.stderr
    assert (f"{repo}:{pinned} were built against torch 2.10.0+cu130; {e2e.stock.tag} has "
            f"torch {TORCH_VERSION}: not used") in refused.stderr
    record = json.loads((tmp_path / "torch.json").read_text())
    assert (record["kernels_from"]["outcome"], record["status"]) == ("refused", "up-to-date")
    down = "127.0.0.1:9"  # the discard port: nothing listens
    fallback = e2e.build(f"{PREFIX}:patched", "--kernels-from", f"{down}/k", "--report",
                         str(tmp_path / "down.json"))
    assert fallback.returncode == 0, fallback.stderr
    line = next(x for x in fallback.stderr.splitlines() if f"no kernels from {down}/k" in x)
    assert line.strip().startswith(f"cannot resolve {down}/k:{pinned}: ")
    assert json.loads((tmp_path / "down.json").read_text())["kernels_from"]["outcome"] == \
        "unreachable"
    with silent_listener() as silent:  # a registry that accepts and never answers
        e2e.env["SM121_REGISTRY_TIMEOUT"] = "3"
        try:
            waited = e2e.build(f"{PREFIX}:patched", "--kernels-from", f"{silent}/k",
                               "--report", str(tmp_path / "silent.json"))
            injected = e2e.run("inject", "--from", f"{silent}/k:{pinned}", "--base",
                               e2e.stock.tag, "--tag", f"{PREFIX}:never")
        finally:
            del e2e.env["SM121_REGISTRY_TIMEOUT"]
    assert waited.returncode == 0, waited.stderr
    assert (f"cannot resolve {silent}/k:{pinned}: no answer in 3 s (set SM121_REGISTRY_TIMEOUT "
            f"to wait longer): no kernels from {silent}/k") in waited.stderr
    assert json.loads((tmp_path / "silent.json").read_text())["kernels_from"]["outcome"] == \
        "unreachable"
    assert injected.returncode == 7, injected.stderr
    errors = [x for x in injected.stderr.splitlines() if x.startswith("error: ")]
    assert errors == [f"error: cannot resolve {silent}/k:{pinned}: no answer in 3 s (set "
                      "SM121_REGISTRY_TIMEOUT to wait longer)"], injected.stderr
    assert not e2e.exists(f"{PREFIX}:never")
    for source in (repo, f"{down}/k"):
        failed = e2e.build(f"{PREFIX}:patched", "--kernels-from", source, "--no-build")
        assert failed.returncode == 2, failed.stderr
        assert failed.stderr.strip().splitlines()[-1].startswith(
            f"error: no kernels image for {e2e.stock.tag} in {source} (")


def _ctrl_c_during_the_kernels_pull(e2e: E2E, registry: str) -> None:
    """Ctrl-C while the kernels image is being pulled (the registry stalls on its first
    blob): exit 130, nothing tagged, no temporary folder, no image left."""
    images = {i.id for i in e2e.client.images.list(all=True)}
    tmp = Path(e2e.env["TMPDIR"])
    with stalling(registry) as proxy:
        ref = f"{proxy.address}/{RUN}/kernels:nightly"
        process = subprocess.Popen(
            [sys.executable, "-m", "sm121_build", "inject", "--from", ref, "--base",
             e2e.stock.tag, "--tag", f"{PREFIX}:interrupted-pull"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e2e.env)
        assert proxy.stalled.wait(120), "the pull never asked for a blob"
        assert list(tmp.iterdir()), "the run's temporary folder should exist while pulling"
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=120)
    assert process.returncode == 130, rest
    assert f"==> kernels {ref}" in rest
    assert rest.strip().splitlines()[-1] == (
        "interrupted: the programs it started were ended, its temporary files and "
        "containers removed")
    assert not e2e.exists(f"{PREFIX}:interrupted-pull")
    assert list(tmp.iterdir()) == []
    assert {i.id for i in e2e.client.images.list(all=True)} == images


def _tampered_kernels(e2e: E2E, context: Path, artifacts: Path, package: str,
                      how: str) -> str:
    """A kernels image like a published one, but holding an extra file (`extra`), a
    changed .so (`sha`), or a manifest naming another torch (`torch`); built with the engine
    directly."""
    root = context / "root"
    (root / package).mkdir(parents=True)
    manifest = json.loads((artifacts / "manifest.json").read_text())
    for name in manifest["files"]:
        (root / package / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(artifacts / name, root / package / name)
    if how == "extra":
        (root / package / "evil.abi3.so").write_bytes(b"\x7fELF not declared")
    elif how == "torch":  # honest files, built (says the manifest) against another torch
        pass
    else:
        first = next(iter(manifest["files"]))
        with open(root / package / first, "ab") as handle:
            handle.write(b"\0")
    (root / "sm121-build").mkdir()
    if how == "torch":
        manifest["torch_version"] = "2.10.0+cu130"
    (root / "sm121-build" / "manifest.json").write_text(json.dumps(manifest))
    (context / "Dockerfile").write_text(
        'FROM scratch\nCOPY root/ /\nLABEL "io.github.sm121-build.kind"="kernels"\n')
    image, _ = e2e.client.images.build(path=str(context), rm=True)
    return str(image.id)


def test_inject_refuses_other_commit(e2e: E2E, patched: subprocess.CompletedProcess[str],
                                     tmp_path: Path) -> None:
    assert patched.returncode == 0, patched.stderr
    other = Path(shutil.copytree(e2e.work / "artifacts", tmp_path / "other"))
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["vllm_commit_id"] = "0" * 40
    (other / "manifest.json").write_text(json.dumps(manifest))
    result = e2e.run("inject", "--artifacts", str(other), "--base", e2e.stock.tag,
                     "--tag", f"{PREFIX}:refused")
    assert result.returncode == 2
    assert result.stderr.strip().endswith("refusing to inject")
    lines = result.stderr.strip().splitlines()  # the inspect step (the pipeline's prelude)
    assert lines[0].startswith("==> inspect ") and lines[-2].startswith("    ✓ inspect ")
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:]
    assert not e2e.exists(f"{PREFIX}:refused")
    manifest["vllm_commit_id"] = e2e.stock.commit  # the right vLLM, built against another torch
    manifest["torch_version"] = "2.10.0+cu130"
    (other / "manifest.json").write_text(json.dumps(manifest))
    result = e2e.run("inject", "--artifacts", str(other), "--base", e2e.stock.tag,
                     "--tag", f"{PREFIX}:refused")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: artifacts in {other} were built against torch 2.10.0+cu130; {e2e.stock.tag} "
        f"has torch {TORCH_VERSION}: refusing to inject (torch's C++ ABI changes between "
        "versions: build for this image instead)")
    assert not e2e.exists(f"{PREFIX}:refused")


def test_verification_failure_tags_nothing(e2e: E2E) -> None:
    """A build that loses a kernel the stock image had (an uncommitted edit of the checkout
    deletes it) is built, fails verification by kernel name, and is removed; exit 3."""
    checkout = e2e.work / "lossy-src"
    subprocess.run(["git", "clone", "-q", str(e2e.stock.checkout), str(checkout)], check=True)
    ops = checkout / "csrc" / "ops.cu"
    text = ops.read_text()
    start = text.index("__global__ void silu_and_mul_kernel")
    ops.write_text(text[:start] + text[text.index("}\n}", start) + 2:])
    images_before = {i.id for i in e2e.client.images.list(all=True)}
    result = e2e.run("--base", e2e.stock.tag, "--source", str(checkout), "--tag",
                     f"{PREFIX}:lossy")
    assert result.returncode == 3, result.stderr
    assert "uncommitted changes in" in result.stderr  # hashed into the content key
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: verification failed: _C.abi3.so: kernel _ZN4vllm19silu_and_mul_kernel")
    assert not e2e.exists(f"{PREFIX}:lossy")
    assert {i.id for i in e2e.client.images.list(all=True)} - images_before == set()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_during_build_leaves_nothing_behind(e2e: E2E, tmp_path: Path,
                                                   signum: signal.Signals) -> None:
    """Ctrl-C, or a CI runner cancelling the job (SIGTERM), in the middle of the compile."""
    containers = {c.id for c in e2e.client.containers.list(all=True)}
    tmp = Path(e2e.env["TMPDIR"])
    # A source the engine's build cache has never seen (an extra untracked file), so the
    # compile step really runs and is still running when Ctrl-C arrives.
    checkout = Path(shutil.copytree(e2e.stock.checkout, tmp_path / "src", symlinks=True))
    (checkout / "sm121-test-nonce.txt").write_text(os.urandom(16).hex())
    process = subprocess.Popen(
        [sys.executable, "-m", "sm121_build", "--base", e2e.stock.tag, "--source",
         str(checkout), "--tag", f"{PREFIX}:interrupted", "--force"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e2e.env)
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("==> build"):
            break
    assert list(tmp.iterdir()), "the build context should exist while building"
    process.send_signal(signum)
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 130, rest
    assert rest.strip().splitlines()[-1] == (
        "interrupted: the programs it started were ended, its temporary files and "
        "containers removed")
    assert not e2e.exists(f"{PREFIX}:interrupted")
    assert list(tmp.iterdir()) == []
    assert {c.id for c in e2e.client.containers.list(all=True)} == containers
    assert not [t for t in e2e.client.images.get(e2e.stock.tag).tags  # the base's pin went
                if t.startswith(f"{PIN_REPO}/")]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_interrupted_rebuild_keeps_the_images_the_user_had(
        e2e: E2E, patched: subprocess.CompletedProcess[str], signum: signal.Signals) -> None:
    """A --force rebuild of an unchanged source is a build-cache hit: the engine hands back
    the ID of the image already tagged. Interrupting it during verify must remove nothing
    the run did not create (it used to force-remove that ID and every tag on it)."""
    assert patched.returncode == 0, patched.stderr
    e2e.client.images.get(f"{PREFIX}:patched").tag(PREFIX, "users-own")
    owned = e2e.client.images.get(f"{PREFIX}:patched").id
    process = subprocess.Popen(
        [sys.executable, "-m", "sm121_build", "--base", e2e.stock.tag, "--source",
         str(e2e.stock.checkout), "--tag", f"{PREFIX}:rebuilt", "--force"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e2e.env)
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("==> verify"):
            break
    process.send_signal(signum)
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 130, rest
    assert not e2e.exists(f"{PREFIX}:rebuilt")
    for tag in ("patched", "users-own"):
        assert e2e.client.images.get(f"{PREFIX}:{tag}").id == owned
    assert e2e.exists(e2e.stock.tag)


def test_rejected_tag_is_refused_before_any_work(e2e: E2E) -> None:
    images = {i.id for i in e2e.client.images.list(all=True)}
    for bad in ("UPPER/case:1", f"{RUN}/x:bad tag"):
        result = e2e.build(bad)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"error: {bad!r} is not a valid image reference (expected NAME[:TAG][@DIGEST], "
            "e.g. vllm/vllm-openai:nightly)"]
    by_id = e2e.run("--base", e2e.client.images.get(e2e.stock.tag).id)
    assert by_id.returncode == 2
    assert "is an image ID, which gives no name to derive the result's tag from" in \
        by_id.stderr
    assert {i.id for i in e2e.client.images.list(all=True)} == images


def test_image_already_native_is_not_rebuilt(e2e: E2E, patched: subprocess.
                                             CompletedProcess[str]) -> None:
    """An image whose extensions already carry sm_121 cubins for everything a 12.1 build
    of its source gives (here: the verified result itself, as a base) is not compiled again;
    --force compiles it anyway."""
    assert patched.returncode == 0, patched.stderr
    report = e2e.work / "not-needed.json"
    result = e2e.run("--base", f"{PREFIX}:patched", "--source", str(e2e.stock.checkout),
                     "--tag", f"{PREFIX}:not-needed", "--report", str(report), *SCOPE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"no rebuild needed: no extension of {PREFIX}:patched "
                                    "gains native sm_121 code from a rebuild")
    assert "==> build" not in result.stderr
    assert "_C.abi3.so: keep (native " in result.stderr
    assert not e2e.exists(f"{PREFIX}:not-needed")
    recorded = json.loads(report.read_text())
    assert recorded["status"] == "not-needed"
    assert recorded["decision"]["rebuild"] is False and recorded["decision"]["chosen"] == []
    native = recorded["decision"]["extensions"]["_C.abi3.so"]
    assert native["before"]["native"] == sum(native["before"].values()) > 0
    assert native["reason"] == "every kernel is already native on sm_121"
    # the stock FA2 of that base is still JIT-only: the plan says so (and --only left it out)
    fa2 = recorded["decision"]["extensions"][FA2]
    assert (fa2["build"], fa2["before"]["jit"], fa2["after"]["jit"]) == (True, 2, 0)
    forced = e2e.run("--base", f"{PREFIX}:patched", "--source", str(e2e.stock.checkout),
                     "--tag", f"{PREFIX}:not-needed", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "==> build" in forced.stderr and e2e.exists(f"{PREFIX}:not-needed")


@pytest.mark.parametrize("buildkit", ["0", "1"])
def test_printed_dockerfile_names_a_base_both_builders_resolve(e2e: E2E, buildkit: str) -> None:
    """The fixture image has no registry digest: `FROM sha256:<id>` would send BuildKit to
    Docker Hub, so the printed Dockerfile names the tag.  Each of its FROM lines is built
    here, offline, with the builder named (the rest of it needs a build context)."""
    printed = e2e.run("dockerfile", "--base", e2e.stock.tag)
    assert printed.returncode == 0, printed.stderr
    assert "has no registry digest; FROM names the tag" in printed.stderr
    froms = [line for line in printed.stdout.splitlines() if line.startswith("FROM ")]
    assert froms and all(line.split()[1] == e2e.stock.tag for line in froms)
    context = e2e.work / f"from-{buildkit}"
    context.mkdir()
    (context / "Dockerfile").write_text(f"{froms[0].split(' AS ')[0]}\nLABEL sm121.test=1\n")
    tag = f"{PREFIX}:from-{buildkit}"
    built = subprocess.run(["/usr/bin/docker", "build", "-q", "-t", tag, str(context)],
                           capture_output=True, text=True, check=False,
                           env={**e2e.env, "DOCKER_BUILDKIT": buildkit})
    assert built.returncode == 0, built.stderr
    assert e2e.exists(tag)
    by_id = e2e.run("dockerfile", "--base", e2e.client.images.get(e2e.stock.tag).id)
    assert by_id.returncode == 2
    assert "is an image ID and the image has no registry digest" in by_id.stderr


FA2 = "vllm_flash_attn/_vllm_fa2_C.abi3.so"


@pytest.fixture(scope="module")
def with_fa2(e2e: E2E) -> subprocess.CompletedProcess[str]:
    """Every extension from the source (`--from-source`): FA2 through the sass-from-ptx
    rule."""
    return e2e.build(f"{PREFIX}:fa2", "--out", str(e2e.work / "fa2-artifacts"),
                     "--report", str(e2e.work / "fa2-report.json"), "--from-source",
                     scope=())


@pytest.fixture(scope="module")
def with_aot(e2e: E2E) -> subprocess.CompletedProcess[str]:
    """The default run: _C/_moe_C (sm_90 cubins only, no PTX) from the source, FA2 (sm_80
    cubins + PTX) by aot of its stock file."""
    return e2e.build(f"{PREFIX}:aot", "--report", str(e2e.work / "aot-report.json"),
                     "--out", str(e2e.work / "aot-artifacts"), scope=())


def test_the_default_run_aots_the_ptx_only_extension_and_builds_the_rest(
        e2e: E2E, with_aot: subprocess.CompletedProcess[str]) -> None:
    assert with_aot.returncode == 0, with_aot.stderr
    assert f"{FA2}: aot (2 JIT-only kernel(s) in 2 fatbin(s) get SASS from the stock file's " \
        "own PTX" in with_aot.stderr
    assert "sass-from-ptx (vllm-flash-attn" not in with_aot.stderr  # FA2's source unused
    assert "external sources" not in with_aot.stderr
    labels = e2e.client.images.get(f"{PREFIX}:aot").labels
    assert labels["io.github.sm121-build.extensions"] == ",".join(INJECTED)
    assert labels["io.github.sm121-build.aot"] == FA2  # placed too: `prove IMAGE` reads both
    audit = json.loads(e2e.run("audit", "--json", "--include", "*/vllm*/_*.so",
                               f"{PREFIX}:aot").stdout)["binaries"]
    found = {Path(b["name"]).name: (b["verdict"], b["cubins"]) for b in audit}
    assert found["_vllm_fa2_C.abi3.so"] == ("native", {"sm_80": 2, "sm_121": 2})
    assert found["_C.abi3.so"][0] == found["_moe_C.abi3.so"][0] == "native"
    record = json.loads((e2e.work / "aot-report.json").read_text())
    jsonschema.Draft202012Validator(schema("report")).validate(record)
    actions = {n: x["action"] for n, x in record["decision"]["extensions"].items()}
    assert actions[FA2] == "aot"
    assert {actions[n] for n in INJECTED} == {"build"}
    assert _changed_files(e2e, f"{PREFIX}:aot") == {*INJECTED, FA2}
    assert (e2e.work / "aot-artifacts" / FA2).is_file()


def test_an_aot_only_run_needs_no_source_and_fetches_nothing(e2e: E2E) -> None:
    """`--only` FA2 with no --source and a repository that does not exist: the plan is aot
    alone, nothing is fetched, the image is verified and tagged; again: up to date."""
    nowhere = str(e2e.work / "no-such-repository")
    plan = e2e.run("--base", e2e.stock.tag, "--tag", f"{PREFIX}:aot-only", "--only",
                   "_vllm_fa2_C", "--repo", nowhere, "--plan")
    assert plan.returncode == 0, plan.stderr
    assert f"plan: aot {FA2} for 12.1; nothing built (--plan)" in plan.stdout
    done = e2e.run("--base", e2e.stock.tag, "--tag", f"{PREFIX}:aot-only", "--only",
                   "_vllm_fa2_C", "--repo", nowhere)
    assert done.returncode == 0, done.stderr
    assert "source (" not in done.stderr
    assert "aot (1 file(s), " in done.stderr  # the aot step
    assert f"tagged {PREFIX}:aot-only" in done.stdout
    audit = json.loads(e2e.run("audit", "--json", "--include", "*/vllm_flash_attn/*.so",
                               f"{PREFIX}:aot-only").stdout)["binaries"]
    assert [b["kernel_counts"] for b in audit] == [{"native": 2, "jit": 0, "none": 0}]
    again = e2e.run("--base", e2e.stock.tag, "--tag", f"{PREFIX}:aot-only", "--only",
                    "_vllm_fa2_C", "--repo", nowhere)
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stdout
    assert "aot (1 file(s), " not in again.stderr  # the key is known before aot: no ptxas


def test_the_default_run_makes_the_ptx_only_flash_attention_native(
        e2e: E2E, with_fa2: subprocess.CompletedProcess[str]) -> None:
    """The stock FA2 is sm_80 cubins + PTX (JIT-only on sm_121): the default run (no --ext)
    plans it, fetches the flash-attention commit the source pins (a local repository standing
    in for GitHub), inserts sass-from-ptx into its set_gencode_flags_for_srcs, and the image
    gets sm_121 SASS compiled from the very compute_80 PTX the driver would JIT."""
    assert with_fa2.returncode == 0, with_fa2.stderr
    assert f"{FA2}: build (native 0→2, JIT 2→0, none 0→0 of 2): 2 JIT-only kernel(s) get " \
        "sm_12x SASS from the same PTX (rule sass-from-ptx)" in with_fa2.stderr
    assert "sass-from-ptx (vllm-flash-attn, CUDA_ARCHS 12.1): applied" in with_fa2.stderr
    labels = e2e.client.images.get(f"{PREFIX}:fa2").labels
    assert labels["io.github.sm121-build.extensions"] == ",".join((*INJECTED, FA2))
    audit = json.loads(e2e.run("audit", "--json", "--include", "*/vllm_flash_attn/*.so",
                               f"{PREFIX}:fa2").stdout)["binaries"]
    stock = json.loads(e2e.run("audit", "--json", "--include", "*/vllm_flash_attn/*.so",
                               e2e.stock.tag).stdout)["binaries"]
    assert [(b["verdict"], b["cubins"], b["ptx"], b["rebuild"]["verdict"]) for b in stock] == [
        ("jit", {"sm_80": 2}, {"sm_80": 2}, "fixable")]
    assert [(b["verdict"], b["cubins"], b["ptx"], b["kernel_counts"]) for b in audit] == [
        ("native", {"sm_80": 2, "sm_121": 2}, {"sm_80": 2},
         {"native": 2, "jit": 0, "none": 0})]
    manifest = json.loads((e2e.work / "fa2-artifacts" / "manifest.json").read_text())
    assert manifest["files"][FA2]["cubins"] == {"sm_80": 2, "sm_121": 2}
    assert (e2e.work / "fa2-artifacts" / FA2).is_file()
    record = json.loads((e2e.work / "fa2-report.json").read_text())
    jsonschema.Draft202012Validator(schema("report")).validate(record)
    jsonschema.Draft202012Validator(schema("manifest")).validate(manifest)
    assert manifest["external"] == {"vllm-flash-attn": record["external"]["vllm-flash-attn"][
        "commit"]}
    fa_repo = e2e.stock.checkout.parent / f"{e2e.stock.checkout.name}-flash-attention"
    head = subprocess.run(["git", "-C", str(fa_repo), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert record["external"]["vllm-flash-attn"] == {"commit": head,
                                                     "repository": str(fa_repo)}


def test_flash_attention_injection_changes_only_the_three_files(
        e2e: E2E, with_fa2: subprocess.CompletedProcess[str]) -> None:
    assert with_fa2.returncode == 0, with_fa2.stderr
    assert _changed_files(e2e, f"{PREFIX}:fa2") == {*INJECTED, FA2}


def test_ext_without_an_sm12x_implementation_is_refused(e2e: E2E) -> None:
    result = e2e.build(f"{PREFIX}:fa3", "--ext", "_vllm_fa3_C")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: _vllm_fa3_C (vllm-flash-attn) has no sm_12x implementation this tool can "
        "build: no rule in patches/ extends its guard (rebuildable here: _vllm_fa2_C)")
    assert not e2e.exists(f"{PREFIX}:fa3")


def test_flash_attention_artifacts_inject_to_the_same_image(
        e2e: E2E, with_fa2: subprocess.CompletedProcess[str]) -> None:
    assert with_fa2.returncode == 0, with_fa2.stderr
    result = e2e.run("inject", "--artifacts", str(e2e.work / "fa2-artifacts"), "--base",
                     e2e.stock.tag, "--tag", f"{PREFIX}:fa2-injected")
    assert result.returncode == 0, result.stderr
    built = _flat_files(e2e.client, f"{PREFIX}:fa2")
    injected = _flat_files(e2e.client, f"{PREFIX}:fa2-injected")
    assert built == injected


def test_aot_of_an_image_tags_it_like_the_main_job(e2e: E2E) -> None:
    """`sm121-build aot IMAGE`: the main job's aot actions alone (FA2), no source."""
    tag = f"{PREFIX}:aot-image"
    done = e2e.run("aot", e2e.stock.tag, "--tag", tag)
    assert done.returncode == 0, done.stderr
    # tagged, or up to date where an aot-only run of this base made the same image already
    assert f"tagged {tag}" in done.stdout or f"up to date: {tag} " in done.stdout
    assert "source (" not in done.stderr
    audit = json.loads(e2e.run("audit", "--json", "--include", "*/vllm*/_*.so", tag).stdout)
    found = {Path(b["name"]).name: b["kernel_counts"] for b in audit["binaries"]}
    assert found["_vllm_fa2_C.abi3.so"] == {"native": 2, "jit": 0, "none": 0}
    assert _changed_files(e2e, tag) == {FA2}
    again = e2e.run("aot", e2e.stock.tag, "--tag", tag)
    assert again.returncode == 0, again.stderr
    assert f"up to date: {tag} " in again.stdout and "--force" not in again.stdout  # none


def test_another_gpu_is_served_end_to_end_and_its_files_are_refused_by_the_spark(
        e2e: E2E) -> None:
    """`aot IMAGE --gpu sm_120` (an RTX 50-series): FA2's PTX compiled for sm_120, verified
    native there, tagged `-sm120`, labelled and exported for sm_120; those files are refused
    by a run for the Spark (before the engine), and taken by one for sm_120."""
    out = e2e.work / "sm120-artifacts"
    done = e2e.run("aot", e2e.stock.tag, "--gpu", "sm_120", "--out", str(out))
    assert done.returncode == 0, done.stderr
    tag = f"{e2e.stock.tag}-sm120"
    assert f"tagged {tag}" in done.stdout or f"up to date: {tag} " in done.stdout
    assert "for sm_120: --gpu; aot alone" in done.stderr
    labels = e2e.client.images.get(tag).labels
    assert labels["io.github.sm121-build.gpu"] == "sm_120"
    assert labels["io.github.sm121-build.arch-list"] == "12.0"
    audit = json.loads(e2e.run("audit", "--json", "--target", "sm_120", "--driver", "13.0",
                               "--include", "*/vllm_flash_attn/*.so", tag).stdout)["binaries"]
    assert [(b["kernel_counts"], set(b["cubins"])) for b in audit] == [
        ({"native": 2, "jit": 0, "none": 0}, {"sm_80", "sm_120"})]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["gpu"] == "sm_120" and manifest["arch_list"] == "12.0"
    spark = e2e.run("inject", "--artifacts", str(out), "--base", e2e.stock.tag, "--tag",
                    f"{PREFIX}:wrong-gpu")
    assert spark.returncode == 2
    assert "were made for sm_120; this run serves sm_121" in spark.stderr
    again = e2e.run("inject", "--artifacts", str(out), "--base", e2e.stock.tag, "--gpu",
                    "sm_120", "--tag", f"{PREFIX}:sm120-injected")
    assert again.returncode == 0, again.stderr
    assert e2e.client.images.get(f"{PREFIX}:sm120-injected").labels[
        "io.github.sm121-build.gpu"] == "sm_120"


def test_aot_of_every_package_of_an_image(e2e: E2E, tmp_path: Path) -> None:
    """`aot IMAGE --all-packages`: beside vLLM's FA2, a JIT-only library of another
    distribution (as NVIDIA's wheels install theirs, under `nvidia/`, with a RECORD) and a
    library whose only fatbin lies in `.data`, which aot cannot reach: the first two are
    made native in the pristine base and verified, the third is left and said; the default
    run leaves every file outside vLLM alone."""
    site = "/usr/local/lib/python3.11/dist-packages"
    lib = "nvidia/cu13/lib/libjitonly.so.13"
    jit = compile_cached("all-pkgs-jit", DATA / "kernels.cu", gencode("compute_80:compute_80"))
    fatbin = compile_device_file("all-pkgs-ptx", DATA / "kernels.cu", "fatbin",
                                 gencode("compute_80:compute_80")).read_bytes()
    (tmp_path / "data.c").write_text(
        f"unsigned char blob[{len(fatbin)}] __attribute__((aligned(8), used)) = "
        f"{{{','.join(map(str, fatbin))}}};\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libdata.so"),
                    str(tmp_path / "data.c")], check=True)
    shutil.copy(jit, tmp_path / "libjitonly.so.13")
    (tmp_path / "RECORD").write_text(f"{lib},,\nnvidia/cu13/lib/libdata.so,,\n")
    (tmp_path / "Dockerfile").write_text(
        f"FROM {e2e.stock.tag}\n"
        f"COPY libjitonly.so.13 {site}/{lib}\n"
        f"COPY libdata.so {site}/nvidia/cu13/lib/libdata.so\n"
        f"COPY RECORD {site}/nvidia_fake_cu13-1.0.dist-info/RECORD\n")
    base = f"{PREFIX}:all-packages-base"
    e2e.client.images.build(path=str(tmp_path), tag=base, rm=True)
    before = json.loads(e2e.run("audit", "--json", base).stdout)
    by_name = {p["name"]: p for p in before["packages"]}
    assert by_name["nvidia-fake-cu13"]["aot"]["files"] == 1
    assert by_name["nvidia-fake-cu13"]["beyond_aot"] == 1  # libdata.so: .data only

    plain = e2e.run("aot", base, "--tag", f"{PREFIX}:all-packages-plain")
    assert plain.returncode == 0, plain.stderr
    assert lib not in plain.stdout + plain.stderr  # vLLM's files only, by default

    tag = f"{PREFIX}:all-packages"
    done = e2e.run("aot", base, "--all-packages", "--tag", tag)
    assert done.returncode == 0, done.stderr
    assert f"tagged {tag}" in done.stdout, done.stdout
    after = json.loads(e2e.run("audit", "--json", tag).stdout)
    counts = {b["name"].removeprefix(site + "/"): b["kernel_counts"] for b in after["binaries"]
              if b["kernel_counts"]}
    assert counts[lib] == {"native": 4, "jit": 0, "none": 0}
    assert counts[f"vllm/{FA2}"]["jit"] == 0
    assert counts["nvidia/cu13/lib/libdata.so"]["native"] == 0  # out of aot's reach
    changed = {p.removeprefix(site.lstrip("/") + "/") for p in
               _changed_between(e2e, base, tag)}
    assert changed == {lib, f"vllm/{FA2}"}
    assert e2e.run("aot", str(tmp_path / "libdata.so"), "--all-packages", "--out",
                   str(tmp_path / "o")).returncode == 2  # files are aot'd whole already


def _changed_between(e2e: E2E, one: str, other: str) -> set[str]:
    before, after = _flat_files(e2e.client, one), _flat_files(e2e.client, other)
    return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}


# --- prove IMAGE: every child in a container of the image; the GPU is FAKE -----------------

FAKE_STORIES = ("proven", "hopper", "schema", "no-gpu")


@pytest.fixture(scope="module")
def fake_gpu_images(e2e: E2E, with_aot: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """FAKE: `{PREFIX}:aot` with the FAKE interpreter (devkit/fake_gpu.py) added at
    /usr/local/bin/fake-python, one tag per story (FAKE_MODE in its environment).  Labels
    are inherited: each says of itself what `{PREFIX}:aot` says."""
    assert with_aot.returncode == 0, with_aot.stderr
    context = e2e.work / "fake-gpu"
    context.mkdir()
    fake_python(context / "fake-python", "/usr/bin/python3")
    tags = {}
    for story in FAKE_STORIES:
        (context / "Dockerfile").write_text(
            f"FROM {PREFIX}:aot\nCOPY fake-python /usr/local/bin/fake-python\n"
            f"ENV FAKE_MODE={story}\n"
            # as vLLM's images have one (`vllm serve`): prove must run its own program
            'ENTRYPOINT ["/bin/false"]\n')
        tags[story] = f"{PREFIX}:fake-gpu-{story}"
        e2e.client.images.build(path=str(context), tag=tags[story], rm=True)
    return tags


def _prove_image(e2e: E2E, image: str, *extra: str, requests: Path | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """`prove IMAGE --python /usr/local/bin/fake-python`; with `requests`, through the CLI
    whose engine gives no GPU and logs each request there (devkit.fake_gpu)."""
    args = ["prove", image, "--python", "/usr/local/bin/fake-python", *extra]
    if requests is None:
        return e2e.run(*args)
    requests.touch()
    return subprocess.run([sys.executable, "-m", "devkit.fake_gpu", *args], capture_output=True,
                          text=True, check=False, cwd=ROOT,
                          env={**e2e.env, "FAKE_GPU_REQUESTS": str(requests)})


def _gpu_containers(e2e: E2E) -> list[str]:
    return [c.name for c in e2e.client.containers.list(
        all=True, filters={"label": "io.github.sm121-build.reader=gpu"})]


def test_prove_image_runs_each_child_in_a_container_of_the_image(
        e2e: E2E, fake_gpu_images: dict[str, str], tmp_path: Path) -> None:
    """The proof of a made image: its placed files read from it, their stock copies from its
    base, every child (the probe, the loader, each harness run, the comparison) in a
    throwaway container of the image that asked the engine for the GPU; the image itself
    unchanged and nothing left behind."""
    image = fake_gpu_images["proven"]
    before = e2e.client.images.get(image).id
    out = tmp_path / "proof.json"
    done = _prove_image(e2e, image, "--json", str(out), requests=tmp_path / "requests")
    assert done.returncode == 0, done.stderr
    proof = json.loads(out.read_text())
    # issue 63: the file no harness runs has its added kernels never launched, so the
    # verdict says how much was proven (every harnessed file's kernels were: all launched)
    unharnessed = [f for f in proof["files"] if not f["harness"]]
    never = sum(len(f["coverage"]["never_launched"]) for f in unharnessed)
    assert unharnessed and never > 0
    assert all(not f["coverage"]["never_launched"] for f in proof["files"] if f["harness"])
    total = proof["coverage"]
    assert total["never_launched"] == never
    assert f"verdict: partial: proven for {total['compared']} of {total['added']} added " \
        f"kernels; {never} never launched" in done.stdout
    jsonschema.Draft202012Validator(schema("proof")).validate(proof)
    labels = e2e.client.images.get(image).labels
    assert proof["subject"] == {"image": image, "image_id": before, "files": None,
                                "stock": None,
                                "base": labels["org.opencontainers.image.base.digest"]}
    placed = [*labels["io.github.sm121-build.extensions"].split(","),
              labels["io.github.sm121-build.aot"]]
    assert sorted(f["name"] for f in proof["files"]) == sorted(placed)
    for item in proof["files"]:  # the bytes proven are the image's (= the exported files)
        exported = e2e.work / "aot-artifacts" / item["name"]
        assert item["sha256"] == hashlib.sha256(exported.read_bytes()).hexdigest()
        assert item["cubins"] and all(c["loaded"] for c in item["cubins"])
    harnessed = [f for f in proof["files"] if f["harness"]]
    assert {f["harness"] for f in harnessed} == {"harness_fa2.py", "harness_marlin.py"}
    assert len(proof["ops"]) == 2 * len(harnessed)
    # the probe, the loader, and per harnessed file three harness runs and a comparison
    asked = (tmp_path / "requests").read_text().splitlines()
    assert len(asked) == 2 + 4 * len(harnessed)
    assert e2e.client.images.get(image).id == before
    assert _gpu_containers(e2e) == []


def test_prove_image_refusals(e2e: E2E, fake_gpu_images: dict[str, str], tmp_path: Path
                              ) -> None:
    """Each refusal is one line, before any op runs, with nothing left behind."""
    # this engine has no NVIDIA Container Toolkit: the real device request is refused
    line = one_line_error(e2e.run("prove", fake_gpu_images["proven"], "--python",
                                  "/usr/local/bin/fake-python"))
    assert "the Docker engine cannot give a container the GPU (could not select device " \
        "driver" in line
    stories = {"hopper": f"{fake_gpu_images['hopper']} serves sm_121; this GPU is sm_90",
               "no-gpu": "no GPU to prove on: cuInit: CUDA_ERROR_NO_DEVICE",
               "schema": "the harness_"}
    for story, said in stories.items():
        line = one_line_error(_prove_image(e2e, fake_gpu_images[story],
                                           requests=tmp_path / story))
        assert said in line, (story, line)
    stock = one_line_error(_prove_image(e2e, e2e.stock.tag, requests=tmp_path / "stock"))
    assert "label: it was not made by sm121-build" in stock
    assert (tmp_path / "stock").read_text() == ""  # refused before any container
    both = e2e.run("prove", fake_gpu_images["proven"], "--files", str(tmp_path))
    assert both.returncode == 2 and "give IMAGE, or --files DIR and --stock DIR" in both.stderr
    # labels an attacker wrote: a name out of the package, a base that is not here
    hostile = {"io.github.sm121-build.extensions": "../../../etc/shadow.so",
               "org.opencontainers.image.base.digest": f"{PREFIX}-gone@sha256:{'0' * 64}",
               "io.github.sm121-build.gpu": "sm_" + "9" * (100 << 10)}  # past 64 KiB (issue 62)
    for key, value in hostile.items():
        context = tmp_path / key
        context.mkdir()
        # (a Dockerfile line is at most 64 KiB: a longer value is continued line by line)
        lines = "\\\n".join(value[i:i + 60000] for i in range(0, len(value), 60000))
        (context / "Dockerfile").write_text(f'FROM {fake_gpu_images["proven"]}\n'
                                            f'LABEL {key}="{lines}"\n')
        tag = f"{PREFIX}:hostile-{len(value)}"
        e2e.client.images.build(path=str(context), tag=tag, rm=True)
        line = one_line_error(_prove_image(e2e, tag, requests=tmp_path / f"{key}.log"))
        assert ("not a relative .so path" if "extensions" in key else
                "label is" if "gpu" in key else "which is not in the engine") in line, line
        assert len(line) < 1000  # a label's value is never a line of its length
        assert (tmp_path / f"{key}.log").read_text() == ""
    assert _gpu_containers(e2e) == []


def test_a_signed_proof_travels_with_the_kernels_image(
        e2e: E2E, fake_gpu_images: dict[str, str], tmp_path: Path) -> None:
    """The nightly's story: `prove IMAGE --json --sign-key`, then `kernels publish --proof`
    attaches it as a signed statement beside the kernels image in a registry on loopback;
    `kernels verify` and `inject --from --trust-key` show it; a proof of other files, a
    failed one and one without --sign-key are refused before anything is pushed."""
    signing, trusted = key_pair(tmp_path, "ours")
    proof = tmp_path / "proof.json"
    done = _prove_image(e2e, fake_gpu_images["proven"], "--json", str(proof), "--sign-key",
                        str(signing), requests=tmp_path / "requests")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "proof.json.sig").is_file()
    artifacts = e2e.work / "aot-artifacts"
    with local_registry(tmp_path) as registry:
        repo = f"{registry}/{RUN}/proven"
        try:
            _other_files_or_unsigned_proofs_are_refused(e2e, tmp_path, artifacts, repo,
                                                        (signing, trusted), proof)
            # the image holds a file no harness runs (its kernels never launched): the
            # proof is partial (issue 63), refused as whole, attached when the user says so
            whole = one_line_error(e2e.run(
                "kernels", "publish", "--artifacts", str(artifacts), "--to", repo,
                "--sign-key", str(signing), "--proof", str(proof)), 3)
            assert "not attached as a whole proof (give --partial-proof" in whole
            published = e2e.run("kernels", "publish", "--artifacts", str(artifacts), "--to",
                                repo, "--sign-key", str(signing), "--proof", str(proof),
                                "--partial-proof")
            assert published.returncode == 0, published.stderr
            total = json.loads(proof.read_text())["coverage"]
            line = (f"partial (proven for {total['compared']:,} of {total['added']:,} added "
                    f"kernels; {total['never_launched']:,} never launched) on FAKE GB10 "
                    "(sm_121), driver 580.95.05 (CUDA 13.0), "
                    f"{json.loads(proof.read_text())['made'][:10]}: ")
            assert line in published.stderr and "proof attached: " in published.stderr
            pinned = published.stdout.split()[1]
            vouched = e2e.run("kernels", "verify", pinned, "--trust-key", str(trusted))
            assert vouched.returncode == 0, vouched.stderr
            assert line in vouched.stderr, vouched.stderr
            assert "op cases bitwise equal to the stock JIT" in vouched.stderr
            json.loads(vouched.stdout)  # the provenance, as before
            fetched = e2e.run("inject", "--from", pinned, "--trust-key", str(trusted),
                              "--base", e2e.stock.tag, "--tag", f"{PREFIX}:proven-from")
            assert fetched.returncode == 0, fetched.stderr
            assert line in fetched.stderr
            # the same image signed, without a proof: said, not refused
            bare = e2e.run("kernels", "publish", "--artifacts", str(artifacts), "--to",
                           f"{registry}/{RUN}/bare", "--sign-key", str(signing))
            assert bare.returncode == 0, bare.stderr
            said = e2e.run("kernels", "verify", bare.stdout.split()[1], "--trust-key",
                           str(trusted))
            assert said.returncode == 0 and "note: no proof signed by" in said.stderr
            # ... then the proof attached beside it, as the nightly does after `prove`
            other_key, _other_pub = key_pair(tmp_path, "theirs")
            refused = one_line_error(e2e.run(
                "kernels", "attest", bare.stdout.split()[1], "--proof", str(proof),
                "--sign-key", str(other_key), "--partial-proof"), 3)
            assert "no https://sm121-build.dev/provenance/v1 statement about" in refused
            attached = e2e.run("kernels", "attest", bare.stdout.split()[1], "--proof",
                               str(proof), "--sign-key", str(signing), "--trust-key",
                               str(trusted), "--partial-proof")
            assert attached.returncode == 0, attached.stderr
            assert attached.stdout.strip().endswith(".att")
            said = e2e.run("kernels", "verify", bare.stdout.split()[1], "--trust-key",
                           str(trusted))
            assert said.returncode == 0 and line in said.stderr, said.stderr
        finally:
            for image in e2e.client.images.list():
                for tag in image.tags:
                    if tag.startswith(f"{registry}/{RUN}/"):
                        e2e.client.images.remove(tag, force=True)


def _other_files_or_unsigned_proofs_are_refused(e2e: E2E, tmp_path: Path, artifacts: Path,
                                               repo: str, keys: tuple[Path, Path],
                                               proof: Path) -> None:
    signing, _trusted = keys  # (a proof's own signature: tests/unit/test_proof_reading.py)
    data = json.loads(proof.read_text())
    other = json.loads(proof.read_text())
    other["files"][0]["sha256"] = "0" * 64
    failed = {**data, "verdict": "failed", "problems": ["x"]}
    for name, document, said in (("other.json", other, "is another file"),
                                 ("failed.json", failed, "its verdict is failed")):
        (tmp_path / name).write_text(json.dumps(document))
        line = one_line_error(e2e.run("kernels", "publish", "--artifacts", str(artifacts),
                                      "--to", repo, "--sign-key", str(signing), "--proof",
                                      str(tmp_path / name)), 3)
        assert said in line, line
    unsigned = one_line_error(e2e.run(
        "kernels", "publish", "--artifacts", str(artifacts), "--to", repo, "--proof",
        str(proof)))
    assert "--proof is attached as a statement the key signs" in unsigned
    assert not [t for i in e2e.client.images.list() for t in i.tags if t.startswith(repo)]
