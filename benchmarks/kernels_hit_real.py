"""A kernels-image hit at real size: vLLM 0.33.0's real files, aot'd once, published to a
registry, then used by a machine with empty caches; against the cold aot run, in one run.

Run (needs a Docker engine, Debian's docker-registry, ptxas; ~25 min on 2 cores):

    python benchmarks/kernels_hit_real.py

The base: PyPI's vLLM 0.33.0 and torch 2.11.0 aarch64 wheels unpacked as pip lays them out
(benchmarks/image_packages.py's image, these two wheels; no compiler in it, so the plan is
aot alone: `_C_stable_libtorch`, `_moe_C_stable_libtorch`, FA2 — 83 modules, 716 MB of PTX).

  cold  `sm121-build --base IMAGE --kernels-to REPO` with empty caches and state: the aot of
        every module, verification, the tag, and the verified files pushed as a kernels image
  hit   a fresh machine: a second Docker engine (its own data root, started here and removed
        after) that holds the base alone (`docker save | docker load`, as a Spark that pulled
        it), caches and state empty: `sm121-build --base IMAGE --kernels-from REPO
        --no-build`, which pulls the kernels image for real (none of its layers is there:
        the first engine's BuildKit keeps the layers it built, so a hit there pulls 0 B),
        verifies it in full against the base and tags

Printed: both walls (command to tag) and the hit's share of the cold run (goal ≤ 2 %), the
bytes the hit pulled (the kernels image's manifest: config and layers) against the base's
size, and the steps of each run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import image_packages  # noqa: E402
from kernels_reuse import pulled_bytes  # noqa: E402

from devkit.registry import local_registry  # noqa: E402

CLI = [sys.executable, "-m", "sm121_build", "--progress", "plain"]
GOAL = 0.02
PREFIX = "sm121-bench/hit"
BRIDGE = "sm121hit0"  # the second engine's own network bridge


def base_image() -> str:
    image_packages.WHEELS = image_packages.WHEELS[:2]  # vLLM and torch
    return image_packages.image(image_packages.wheels())


def timed(args: list[str], env: dict[str, str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}); see {log}:\n"
                         + log.read_text()[-3000:])
    return elapsed


def fresh_env(work: Path, name: str) -> dict[str, str]:
    """A machine state with nothing in it: caches, state (ledger, aot pace) and temp."""
    for sub in ("cache", "state", "tmp"):
        (work / name / sub).mkdir(parents=True)
    return {**os.environ, "XDG_CACHE_HOME": str(work / name / "cache"),
            "XDG_STATE_HOME": str(work / name / "state"), "TMPDIR": str(work / name / "tmp")}


@contextlib.contextmanager
def fresh_engine(base: str):  # type: ignore[no-untyped-def]
    """A second dockerd with nothing in it but `base`: DOCKER_HOST for it."""
    root = Path(tempfile.mkdtemp(prefix="sm121-d2-", dir="/tmp"))  # a short socket path
    socket = f"unix://{root}/docker.sock"
    # its own bridge: `--bridge=none` makes a dockerd delete docker0, the first engine's
    subprocess.run(["ip", "link", "add", "name", BRIDGE, "type", "bridge"], check=True)
    subprocess.run(["ip", "addr", "add", "172.30.121.1/24", "dev", BRIDGE], check=True)
    subprocess.run(["ip", "link", "set", BRIDGE, "up"], check=True)
    daemon = subprocess.Popen(
        ["dockerd", "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
         "-H", socket, "--pidfile", str(root / "docker.pid"), "--iptables=false",
         f"--bridge={BRIDGE}", "--containerd-namespace", "sm121hit",
         "--containerd-plugins-namespace", "sm121hitp"],
        stdout=subprocess.DEVNULL, stderr=open(root / "log", "w"))  # noqa: SIM115
    env = {**os.environ, "DOCKER_HOST": socket}
    try:
        for _ in range(60):
            if subprocess.run(["docker", "info"], env=env, capture_output=True,
                              check=False).returncode == 0:
                break
            time.sleep(1)
        save = subprocess.Popen(["docker", "save", base], stdout=subprocess.PIPE)
        subprocess.run(["docker", "load", "-q"], stdin=save.stdout, env=env, check=True,
                       capture_output=True)
        save.wait()
        yield socket
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["ip", "link", "delete", BRIDGE], check=False)


def images_of(repository: str) -> list[str]:
    listed = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}",
                             repository], capture_output=True, text=True, check=True).stdout
    return [line for line in listed.split() if not line.endswith(":<none>")]


def steps(record: Path) -> str:
    data = json.loads(record.read_text())
    return ", ".join(f"{s['name'].split(' (')[0]} {s['seconds']:.1f}s" for s in data["steps"])


def main() -> int:
    base = base_image()
    size = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", base],
                              capture_output=True, text=True, check=True).stdout)
    print(f"base {base}: {size / 1e9:.2f} GB", flush=True)
    with tempfile.TemporaryDirectory(prefix="sm121-bench-hit-", dir=ROOT / ".cache") as tmp:
        work = Path(tmp)
        with local_registry(work) as registry:
            repo = f"{registry}/bench/kernels033"
            cold_s = timed([*CLI, "--base", base, "--tag", f"{PREFIX}:cold", "--kernels-to",
                            repo, "--report", str(work / "cold.json")],
                           fresh_env(work, "cold"), work / "cold.log")
            print(f"cold: {cold_s:.1f} s ({steps(work / 'cold.json')})", flush=True)
            pushed = images_of(f"{registry}/bench/kernels033")
            tags = [t.rsplit(":", 1)[1] for t in pushed]
            subprocess.run(["docker", "rmi", f"{PREFIX}:cold", *pushed], check=True,
                           capture_output=True)  # this run's own images: the hit pulls
            pulled = max(pulled_bytes(registry, "bench/kernels033", t) for t in tags)
            with fresh_engine(base) as socket:
                hit_s = timed([*CLI, "--base", base, "--tag", f"{PREFIX}:hit",
                               "--kernels-from", repo, "--no-build", "--report",
                               str(work / "hit.json")],
                              {**fresh_env(work, "hit"), "DOCKER_HOST": socket},
                              work / "hit.log")
            print(f"hit: {hit_s:.1f} s ({steps(work / 'hit.json')})")
            record = json.loads((work / "hit.json").read_text())
            print(f"hit status {record['status']}, kernels {record['kernels_from']['outcome']}")
            for line in (work / "hit.log").read_text().splitlines():
                if "pulled" in line or "verif" in line:
                    print(f"  | {line.strip()[:160]}")
    share = hit_s / cold_s
    print(f"\n{'':40} {'value':>10} {'reference':>10} {'ratio':>8}  goal")
    print(f"{'hit run vs cold aot run (s)':40} {hit_s:10.1f} {cold_s:10.1f} {share:8.2%}  "
          f"<= {GOAL:.0%} {'met' if share <= GOAL else 'MISSED'}")
    print(f"{'bytes pulled vs the base image':40} {pulled / 1e6:9.0f}M {size / 1e9:9.2f}G "
          f"{pulled / size:8.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
