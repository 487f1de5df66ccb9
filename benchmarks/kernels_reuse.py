"""Build once, inject everywhere: time `sm121-build --base IMAGE --kernels-from REPO` on a
real-size image, from the command to a verified, tagged image, against `docker save` of the
same image (measured in the same run) and against the cold compile of docs/real-build.md;
and the bytes the run pulled against the image's size.

Run (needs a Docker engine, Debian's docker-registry, and about 2x FILLER GB of free disk):

    python benchmarks/kernels_reuse.py [--filler-gb 16 | --base sm121-bench/vllm-big:KEY]

The base is benchmarks/image_scale.py's image (built once and kept): the end-to-end tests'
stock-like image, FILLER GB of ordinary layers, and the real `_C.abi3.so`/`_moe_C.abi3.so` of
PyPI's vLLM 0.17.0 aarch64 wheel (583 MB) with torch 2.11.0's real `torch/lib`.  The kernels
image carries the real `_moe_C.abi3.so` (203 MB: no sm_121 build of 0.17.0 can be made on this
machine, and the wheel's own `_C` holds 42 kernels with sm_120a code alone, which a GB10
rebuild compiles for sm_121 and verification rightly finds missing in the wheel's file), with
a manifest written by the tool's own `artifacts.export` for this base, published with
`sm121-build kernels publish` (legacy builder: BuildKit's cache would keep the layer in the
engine) to a registry on loopback, and removed from the engine before the timed run, which
therefore pulls it for real.  Every verification runs in full on the result: kernels by name
against the base's file, the ABI against its torch, drift.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import docker  # noqa: E402
from image_scale import big_image  # noqa: E402

from devkit.registry import local_registry  # noqa: E402
from sm121_build import __version__  # noqa: E402
from sm121_build.cuda.binary import (  # noqa: E402
    DEFAULT_POLICY,
    audit_binary,
)
from sm121_build.image.engine import Engine  # noqa: E402
from sm121_build.image.facts import inspect_image, require_vllm  # noqa: E402
from sm121_build.jobs.formats.artifacts import Provenance, export  # noqa: E402
from sm121_build.source.guard_rules import rules_digest  # noqa: E402

# `_moe_C` only: the real `_C` of the wheel holds 42 kernels with sm_120a code alone, which a
# GB10 rebuild compiles for sm_121 and verification rightly misses in the wheel's own file
KERNELS = ("_moe_C.abi3.so",)
COLD_COMPILE_S = 1318.0  # docs/real-build.md: vLLM 0.17.0 _C + _moe_C, 16 jobs, cold
GOALS = {"cold": 0.02, "bytes": 0.05}
CLI = [sys.executable, "-m", "sm121_build"]


def kernels_folder(base: str, work: Path) -> Path:
    """The real 0.17.0 files as an artifacts folder for `base` (the tool's own manifest)."""
    engine = Engine.connect()
    facts = inspect_image(engine, base)
    vllm = require_vllm(facts)
    stock = work / "stock"
    with engine.reader(facts.id) as files:
        for name in KERNELS:
            files.copy_file(f"{vllm.package_dir}/{name}", stock / name)
    counts = {}
    for name in KERNELS:
        report = audit_binary(stock / name, name, DEFAULT_POLICY, with_kernels=True)
        counts[name] = (report.arch_counts("elf"), report.kernel_counts()["native"])
    provenance = Provenance(
        base=facts.ref, base_digest=facts.digest_ref, vllm_version=vllm.version,
        vllm_commit=vllm.commit_id or "", vllm_commit_id=vllm.commit_id,
        arch_list="12.1", patches=rules_digest(), package_dir=vllm.package_dir,
        tool_version=__version__, external={}, torch_version=vllm.torch_version)
    out = work / "artifacts"
    export(out, {name: stock / name for name in KERNELS}, provenance, counts)
    return out


def pulled_bytes(registry: str, repository: str, tag: str) -> int:
    """Config and layer sizes of a manifest: what a pull onto an engine without it fetches."""
    request = urllib.request.Request(
        f"http://{registry}/v2/{repository}/manifests/{tag}",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json, "
                           "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        manifest = json.load(response)
    return int(manifest["config"]["size"]) + sum(int(x["size"]) for x in manifest["layers"])


def run(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return elapsed, done.stderr


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--filler-gb", type=int, default=16)
    parser.add_argument("--base", help="an image_scale.py image already built (the fixture's "
                        "commit differs per checkout, so its key does too): no new 20 GB image")
    options = parser.parse_args()
    client = docker.from_env(timeout=3600)
    with tempfile.TemporaryDirectory(prefix="sm121-bench-reuse-") as tmp:
        work = Path(tmp)
        base = options.base or big_image(client, work, options.filler_gb)[0]
        image = client.images.get(base)
        size = int(image.attrs["Size"])
        print(f"base {base}: {size / 1e9:.1f} GB, {len(image.attrs['RootFS']['Layers'])} "
              "layers")
        artifacts = kernels_folder(base, work)
        env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"),
               "XDG_STATE_HOME": str(work / "state"), "TMPDIR": str(work)}
        result = "sm121-bench/vllm-big:from-kernels"
        with local_registry(work) as registry:
            repo = f"{registry}/bench/kernels"
            # the legacy builder: BuildKit's cache would keep the layer in the engine, and the
            # timed pull below would find it "already here" instead of pulling it
            publish_s, _ = run([*CLI, "kernels", "publish", "--artifacts", str(artifacts),
                                "--to", repo], {**env, "DOCKER_BUILDKIT": "0"})
            files = sum((artifacts / name).stat().st_size for name in KERNELS)
            pushed = [t for i in client.images.list() for t in i.tags if t.startswith(repo)]
            for tag in pushed:
                client.images.remove(tag)  # the timed run pulls it for real
            pinned = next(t for t in pushed if not t.split(":")[-1].startswith("k-"))
            size_pulled = pulled_bytes(registry, "bench/kernels", pinned.rsplit(":", 1)[1])
            if any(result in i.tags for i in client.images.list()):
                client.images.remove(result)  # this benchmark's own tag from an earlier run
            record_path = work / "record.json"
            used_s, log = run([*CLI, "--base", base, "--kernels-from", repo, "--no-build",
                               "--tag", result, "--report", str(record_path)], env)
            record = json.loads(record_path.read_text())
        client.images.remove(result)
        start = time.perf_counter()
        with open(os.devnull, "wb") as null:
            subprocess.run(["docker", "save", base], stdout=null, check=True)
        save_s = time.perf_counter() - start
    print(f"kernels image {pinned}: {size_pulled / 1e6:.0f} MB to pull ({files / 1e6:.0f} MB "
          f"of .so files); published in {publish_s:.1f} s")
    print(f"run: {record['status']}, kernels {record['kernels_from']['outcome']} "
          f"({record['kernels_from']['digest'][:19]}…)")
    print("steps: " + ", ".join(f"{s['name'].split(' ')[0]} {s['seconds']:.1f}s"
                                for s in record["steps"]))
    pulled = next((line.strip() for line in log.splitlines() if "pulled " in line), "")
    print(pulled)
    rows = [("--kernels-from run, command to tagged", used_s, save_s, None),
            ("  vs cold compile (docs/real-build.md)", used_s, COLD_COMPILE_S, GOALS["cold"]),
            ("bytes pulled vs the image's size", size_pulled, size, GOALS["bytes"])]
    print(f"{'':<40} {'value':>10} {'reference':>10} {'ratio':>8}  goal")
    print(f"{'docker save IMAGE > /dev/null (s)':<40} {save_s:10.1f}")
    for label, value, reference, goal in rows:
        ratio = value / reference
        verdict = "" if goal is None else f"<= {goal:.0%} " + (
            "met" if ratio <= goal else "MISSED")
        unit = f"{value / 1e6:9.0f}M" if value > 1e5 else f"{value:10.1f}"
        ref = f"{reference / 1e9:9.1f}G" if reference > 1e5 else f"{reference:10.1f}"
        print(f"{label:<40} {unit} {ref} {ratio:8.2%}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
