"""A 0.33.0-like image, audited whole: every package's device code, by distribution.

Run (needs a Docker engine and about 3x the image's size of free disk):

    python benchmarks/image_packages.py [--runs 1]

The image holds what PyPI's aarch64 wheels install beside vLLM in an official image: vLLM
0.33.0, torch 2.11.0, flashinfer-cubin 0.6.13 and NVIDIA's CUDA 13 libraries (cuBLAS,
cuFFT 12.0, cuSPARSE, cuSPARSELt, NCCL, NVSHMEM, NVRTC, nvJitLink, the runtime), each wheel
unpacked into `dist-packages` with its own `.dist-info` (RECORD included), as pip lays them
out; built once with `docker import` and kept (tag sm121-bench/packages:<key>).  No Debian
base: the audit reads files, and nothing here runs.

Times, in the same run: `docker save IMAGE > /dev/null` (the reference: the whole image read
out of the engine), `sm121-build audit IMAGE --no-kernels` and `sm121-build audit IMAGE`
(kernel names), both over the whole filesystem; prints each as a fraction of the save, then
the audit's per-package table.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, pypi_download  # noqa: E402

SITE = "usr/local/lib/python3.12/dist-packages"
AARCH64 = "manylinux2014_aarch64"
WHEELS = (  # (spec, folder under .cache, platform to ask pip for, the tag the file carries)
    ("vllm==0.33.0", "wheels", "manylinux_2_28_aarch64", None),
    ("torch==2.11.0", "torch", "manylinux_2_28_aarch64", None),
    ("flashinfer_cubin==0.6.13", "wheels", "any", None),
    *((spec, "nvidia-aarch64", AARCH64, "aarch64") for spec in (
        "nvidia_cublas==13.10.0.20", "nvidia_cufft==12.0.0.61", "nvidia_cusparse==12.9.4.2",
        "nvidia_cusparselt_cu13==0.10.0", "nvidia_nccl_cu13==2.27.7",
        "nvidia_nvshmem_cu13==3.8.0", "nvidia_cuda_nvrtc==13.5.37",
        "nvidia_nvjitlink==13.5.37", "nvidia_cuda_runtime==13.5.37")),
)


def wheels() -> list[Path]:
    return [pypi_download(spec, CACHE / folder, platform=platform, tags=tags)
            for spec, folder, platform, tags in WHEELS]


def image(found: list[Path]) -> str:
    """The image's tag: built now from the wheels' members unless an earlier run kept it."""
    key = hashlib.sha256("\0".join(p.name for p in found).encode()).hexdigest()[:12]
    tag = f"sm121-bench/packages:{key}"
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True,
                      check=False).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        layer = Path(tmp) / "rootfs.tar"
        with tarfile.open(layer, "w") as out:
            for wheel in found:
                with zipfile.ZipFile(wheel) as archive:
                    for info in archive.infolist():
                        if info.is_dir():
                            continue
                        member = tarfile.TarInfo(f"{SITE}/{info.filename}")
                        member.size, member.mode = info.file_size, 0o755 \
                            if info.filename.endswith(".so") or ".so." in info.filename \
                            else 0o644
                        with archive.open(info) as source:
                            out.addfile(member, source)
            marker = tarfile.TarInfo("etc/os-release")
            text = b'ID=debian\nVERSION_ID="12"\n'
            marker.size = len(text)
            out.addfile(marker, io.BytesIO(text))
        subprocess.run(["docker", "import", "--platform", "linux/arm64", str(layer), tag],
                       check=True, capture_output=True)
    return tag


def timed(args: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)}: exit {done.returncode}: {done.stderr[-500:]}")
    return time.perf_counter() - started, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1)
    runs = parser.parse_args().runs
    tag = image(wheels())
    size = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", tag],
                              capture_output=True, text=True, check=True).stdout)
    print(f"{tag}: {size / 1e9:.2f} GB, {len(WHEELS)} wheels unpacked")
    audit = [sys.executable, "-m", "sm121_build", "audit", "--target", "sm_121", "--driver",
             "13.0", tag]
    table = ""
    for run in range(runs):
        save, _ = timed(["sh", "-c", f"docker save {tag} > /dev/null"])
        headers, _ = timed([*audit, "--no-kernels"])
        kernels, table = timed(audit)
        print(f"run {run + 1}: docker save {save:.1f} s; audit --no-kernels {headers:.1f} s "
              f"({headers / save:.0%} of the save); audit with kernel names {kernels:.1f} s "
              f"({kernels / save:.0%})")
    print(table.split("per package, on sm_121:\n", 1)[-1])


if __name__ == "__main__":
    main()
