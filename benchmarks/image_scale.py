"""Real-size images: time `pin`, `audit --include` and the main job's verify step against one
`docker save IMAGE > /dev/null` of the same image, in the same run, and record how large
TMPDIR grew during each.

Run (needs a Docker engine and about 2x FILLER GB of free disk under /var/lib/docker):

    python benchmarks/image_scale.py [--filler-gb 16] [--runs 1]

The image is built once and kept (tag sm121-bench/vllm-big:<key>): the end-to-end tests'
stock-like image (Debian, nvcc 13.0, cmake, the vLLM-shaped fixture package), FILLER GB of
ordinary layers (random bytes, 4 GB a layer, written by RUN so no build context is copied),
and on top the real `_C.abi3.so` / `_moe_C.abi3.so` of PyPI's vLLM 0.17.0 aarch64 wheel
(~580 MB, downloaded once under .cache/vllm), with the RECORD pip writes for a package, and
the real `torch/lib` of PyPI's torch 2.11.0 aarch64 wheel (the libraries verification reads
for the ABI check; downloaded once under .cache/torch).
The main job rebuilds the fixture's sources for 12.1 and verifies them against those real
stock files: verification then reports (exit 3) that the small fixture build lacks the real
wheel's kernels, which is true and expected here; every check still runs in full, and the
step's own timing is what is read.
Prints each step as a fraction of the docker save time, with the targets from issue #12.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import docker  # noqa: E402

from devkit.helpers import CACHE, pypi_download  # noqa: E402
from devkit.stockimage import VERSION, ensure_stock_image  # noqa: E402

WHEEL = "vllm==0.17.0"
TORCH = "torch==2.11.0"
EXTENSIONS = ("_C.abi3.so", "_moe_C.abi3.so")
TARGETS = {"pin": 0.01, "audit": 0.03, "verify": 0.04}  # issue #46 (was 5 / 20 / 10 %)


class TempPeak:
    """The largest total size of the files under a folder, sampled five times a second."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _size(self) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(self.folder):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._size())
            time.sleep(0.2)

    def __enter__(self) -> TempPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._size())


def big_image(client: docker.DockerClient, work: Path, filler_gb: int) -> tuple[str, Path]:
    stock = ensure_stock_image(client, work)
    wheel = pypi_download(WHEEL, CACHE / "vllm")
    torch = pypi_download(TORCH, CACHE / "torch", platform="manylinux_2_28_aarch64")
    key = hashlib.sha256(f"{stock.tag}\0{wheel.name}\0{filler_gb}\0record\0{torch.name}"
                         .encode()).hexdigest()[:12]
    tag = f"sm121-bench/vllm-big:{key}"
    try:
        client.images.get(tag)
        return tag, stock.checkout
    except docker.errors.ImageNotFound:
        pass
    package = stock.package_dir
    with tempfile.TemporaryDirectory(prefix="sm121-bench-ctx-") as tmp:
        ctx = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            for name in EXTENSIONS:
                (ctx / name).write_bytes(zf.read(f"vllm/{name}"))
        lines = [f"FROM {stock.tag}"]
        for number in range(0, filler_gb, 4):
            size = min(4, filler_gb - number)
            lines.append(f"RUN mkdir -p /srv/filler && head -c {size}G /dev/urandom "
                         f"> /srv/filler/part{number // 4}")
        lines += [f"COPY {name} {package}/{name}" for name in EXTENSIONS]
        with zipfile.ZipFile(torch) as zf:
            for member in zf.namelist():
                if member.startswith("torch/lib/lib") and ".so" in member:
                    (ctx / "torch" / "lib").mkdir(parents=True, exist_ok=True)
                    (ctx / member).write_bytes(zf.read(member))
        lines.append(f"COPY torch/lib {package.rsplit('/', 1)[0]}/torch/lib")
        # pip writes a RECORD for every install; the fixture package predates that here
        site = package.rsplit("/", 1)[0]
        (ctx / "RECORD").write_text("".join(
            f"vllm/{name},,\n" for name in ("__init__.py", "_version.py", *EXTENSIONS)))
        lines.append(f"COPY RECORD {site}/vllm-{VERSION}.dist-info/RECORD")
        (ctx / "Dockerfile").write_text("\n".join(lines) + "\n")
        print(f"building {tag} ({filler_gb} GB of filler; minutes)", file=sys.stderr)
        subprocess.run(["/usr/bin/docker", "build", "-q", "-t", tag, str(ctx)], check=True,
                       env={**os.environ, "DOCKER_BUILDKIT": "1"}, stdout=subprocess.DEVNULL)
    return tag, stock.checkout


def timed(args: list[str], tmpdir: Path, env: dict[str, str],
          stdout: int | None = subprocess.DEVNULL) -> tuple[float, int, str]:
    """(seconds, temp peak in bytes, stderr) of one command."""
    with TempPeak(tmpdir) as peak:
        start = time.perf_counter()
        result = subprocess.run(args, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **env, "TMPDIR": str(tmpdir)}, check=False)
        elapsed = time.perf_counter() - start
    if result.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return elapsed, peak.peak, result.stderr


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--filler-gb", type=int, default=16)
    args = parser.parse_args()
    client = docker.from_env(timeout=3600)
    with tempfile.TemporaryDirectory(prefix="sm121-bench-") as tmp:
        work = Path(tmp)
        tag, checkout = big_image(client, work, args.filler_gb)
        image = client.images.get(tag)
        size = int(image.attrs["Size"])
        print(f"image {tag}: {_gb(size)}, {len(image.attrs['RootFS']['Layers'])} layers")
        tmpdir = work / "tmp"
        tmpdir.mkdir()
        cli = [sys.executable, "-m", "sm121_build"]
        rows: list[tuple[str, str, float, int]] = []
        with TempPeak(tmpdir) as peak:
            start = time.perf_counter()
            with open(os.devnull, "wb") as null:
                subprocess.run(["docker", "save", tag], stdout=null, check=True)
            save = time.perf_counter() - start
        rows.append(("docker save IMAGE > /dev/null", "", save, peak.peak))
        cache = {"XDG_CACHE_HOME": str(work / "cache-pin")}
        elapsed, temp, _ = timed([*cli, "pin", tag], tmpdir, cache)
        rows.append(("pin IMAGE (inspect, cold cache)", "pin", elapsed, temp))
        elapsed, temp, _ = timed([*cli, "audit", tag, "--include", "*/vllm/*"], tmpdir, {})
        rows.append(("audit IMAGE --include '*/vllm/*'", "audit", elapsed, temp))
        out = work / "main"
        _, temp, log = timed([*cli, "--base", tag, "--source", str(checkout), "--tag",
                              "sm121-bench/vllm-big:verify", "--force"], tmpdir,
                             {"XDG_CACHE_HOME": str(out)})
        match = re.search(r"^\s+[✓✕] verify \(([\d.]+)s\)$", log, re.MULTILINE)
        if not match:
            raise SystemExit(f"no verify step in the main job's log:\n{log}")
        rows.append(("main job: verify step", "verify", float(match.group(1)), temp))
        abi = re.search(r"ABI: .*", log)
        print(abi.group(0) if abi else "(no ABI line in the main job's log)")
        print(f"{'step':<36} {'seconds':>8} {'of save':>8} {'target':>7}  temp peak")
        for label, key, seconds, temp in rows:
            ratio = seconds / save
            target = TARGETS.get(key)
            verdict = "" if target is None else (
                f"<= {target:.0%} " + ("met" if ratio <= target else "MISSED"))
            print(f"{label:<36} {seconds:8.1f} {ratio:8.1%} {verdict:>12}  {_gb(temp)}")
        print("(the main job's temp peak covers the whole job: build context and verify)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
