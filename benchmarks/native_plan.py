"""What the default run plans on a stock-like image of REAL vLLM 0.33.0, and what it removes.

    python benchmarks/native_plan.py [--sample 4] [--all]

The image (built once, tag sm121-bench/vllm-033:<key>, about 1 GB) holds the real extensions
of PyPI's vLLM 0.33.0 aarch64 wheel (the DGX Spark one) at their package paths, with stand-in
files where the plan only looks (nvcc, g++, cuda.h of CUDA 13.0, Python.h, torch/version.py):
no container runs.  The source is the 0.33.0 sdist as a local git repository whose commit
the image's `_version.py` names.  Downloads are cached under .cache/.

Prints, from one `sm121-build --base IMAGE --source SRC --plan --report R` (timed):
  - per extension: build or keep, and why; kernels native / JIT / none, stock -> planned;
  - the JIT work the plan removes: the PTX modules of the planned extensions whose kernels
    are JIT-only on sm_121, compiled with this machine's ptxas (CUDA 13.0) for sm_121 as the
    driver would, CPU-seconds and SASS bytes measured on `--sample` modules per extension
    (spread over the sizes) and extrapolated by PTX bytes (`--all`: every module);
  - the compile cost of the planned rebuild, from the real builds of docs/real-build.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.helpers import CACHE, cuda_home, git, pypi_download  # noqa: E402
from sm121_build.core.vllm import extension_target  # noqa: E402
from sm121_build.cuda.binary import DEFAULT_POLICY  # noqa: E402
from sm121_build.cuda.compat import entry_verdict  # noqa: E402
from sm121_build.cuda.fatbin import HostBinary  # noqa: E402

VERSION = "0.33.0"
SITE = "/usr/local/lib/python3.12/dist-packages"
# Real builds (docs/real-build.md, 16 jobs on the lent machine): seconds of wall time
COMPILE_S = {"_C_stable_libtorch": (1249.0, "vLLM 0.19.1 _C, 81 ninja steps"),
             "_vllm_fa2_C": (836.6, "flash-attention at vLLM 0.26.0's pin, 80 steps")}


def stock_files(work: Path) -> tuple[Path, dict[str, Path]]:
    wheel = pypi_download(f"vllm=={VERSION}", CACHE / "wheels",
                          platform="manylinux_2_28_aarch64")
    out = work / "vllm"
    files = {}
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith("vllm/") and member.endswith(".abi3.so") and \
                    "third_party" not in member:
                path = work / member
                path.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, path.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
                files[member.removeprefix("vllm/")] = path
    return out, files


def source_repo(work: Path) -> tuple[Path, str]:
    sdist = pypi_download(f"vllm=={VERSION}", CACHE / "sdists", sdist=True)
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "sdist", filter="data", members=[
            m for m in tar.getmembers() if m.name in (prefix + "CMakeLists.txt",
                                                       prefix + "vllm/_version.py",
                                                       prefix + "vllm/__init__.py")
            or m.name.startswith((prefix + "cmake/", prefix + "csrc/ops.h"))])
    repo = work / "sdist" / prefix.rstrip("/")
    (repo / "csrc").mkdir(exist_ok=True)
    (repo / "csrc" / "ops.h").touch()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"vLLM {VERSION} sdist (CMake files)")
    return repo, git(repo, "rev-parse", "HEAD")


def build_image(package: Path, commit: str) -> str:
    import docker

    client = docker.from_env()
    digest = hashlib.sha256(commit.encode() + b"\0v2")
    for path in sorted(package.rglob("*.so")):
        digest.update(path.name.encode() + str(path.stat().st_size).encode())
    tag = f"sm121-bench/vllm-033:{digest.hexdigest()[:12]}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    with tempfile.TemporaryDirectory(prefix="sm121-bench-ctx-") as tmp:
        ctx = Path(tmp)
        site = SITE.lstrip("/")  # relative: joined under the context, never the host's /
        stubs = {"usr/local/cuda-13.0/bin/nvcc": "\x7fELF stand-in\n",
                 "usr/local/cuda-13.0/include/cuda.h": "#define CUDA_VERSION 13000\n",
                 "usr/bin/g++-12": "\x7fELF stand-in\n",
                 "usr/include/python3.12/Python.h": "/* stand-in */\n",
                 f"{site}/torch/version.py": "__version__ = '2.14.0+cu130'\n",
                 f"{site}/vllm/__init__.py": "",
                 f"{site}/vllm/_version.py": f"__version__ = version = {VERSION!r}\n"
                                              f"__commit_id__ = commit_id = {commit!r}\n"}
        root = ctx / "root"
        for rel, text in stubs.items():
            path = root / rel
            assert path.resolve().is_relative_to(root.resolve()), path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        os.symlink("g++-12", root / "usr/bin/g++")
        shutil.copytree(package, root / site / "vllm", dirs_exist_ok=True)
        (ctx / "Dockerfile").write_text(
            "FROM scratch\nCOPY root/ /\n"
            "ENV PATH=/usr/local/cuda-13.0/bin:/usr/local/bin:/usr/bin:/bin\n"
            'CMD ["python3"]\n')
        client.images.build(path=str(ctx), tag=tag, rm=True, platform="linux/arm64")
    return tag


def plan(tag: str, source: Path, work: Path) -> tuple[float, dict[str, object]]:
    report = work / "plan.json"
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache")}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "sm121_build", "--base", tag, "--source",
                             str(source), "--plan", "--report", str(report)],
                            capture_output=True, text=True, env=env, check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"the plan failed ({result.returncode}): {result.stderr[-2000:]}")
    print(result.stderr)
    print(result.stdout)
    return elapsed, json.loads(report.read_text())


def jit_modules(path: Path) -> list[bytes]:
    """The PTX of every translation unit whose best code on sm_121 is PTX (JIT)."""
    modules = []
    with HostBinary.open(path) as binary:
        by_container: dict[int, list[object]] = {}
        for entry in binary.entries:
            by_container.setdefault(entry.container, []).append(entry)
        for entries in by_container.values():
            verdicts = [entry_verdict(e, DEFAULT_POLICY.target, DEFAULT_POLICY.driver)  # type: ignore[arg-type]
                        for e in entries]
            if "native" not in verdicts and "jit" in verdicts:
                ptx = [e for e, v in zip(entries, verdicts, strict=True) if v == "jit"]
                modules.append(binary.payload(ptx[-1]).rstrip(b"\0"))  # type: ignore[arg-type]
    return modules


def ptxas(module: bytes, work: Path, index: int) -> tuple[float, int]:
    """CPU-seconds of ptxas for sm_121 (the driver's JIT, ahead of time) and the SASS size
    (the CPU time from wait4's rusage of that one child)."""
    src, out = work / f"m{index}.ptx", work / f"m{index}.cubin"
    src.write_bytes(module)
    child = subprocess.Popen([str(cuda_home() / "bin" / "ptxas"), "-arch=sm_121", "-O3",
                              str(src), "-o", str(out)])
    _pid, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"ptxas failed on module {index} ({child.returncode})")
    size = out.stat().st_size
    src.unlink()
    out.unlink()
    return usage.ru_utime + usage.ru_stime, size


def jit_removed(name: str, path: Path, sample: int | None, work: Path) -> dict[str, float]:
    modules = sorted(jit_modules(path), key=len)
    if not modules:
        return {"modules": 0, "ptx_mib": 0.0, "cpu_s": 0.0, "sass_mib": 0.0, "measured": 0}
    picked = modules if sample is None or sample >= len(modules) else [
        modules[round(i * (len(modules) - 1) / max(sample - 1, 1))] for i in range(sample)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda item: ptxas(item[1], work, item[0]), enumerate(picked)))
    cpu = sum(seconds for seconds, _ in results)
    sass = float(sum(size for _, size in results))
    scale = sum(map(len, modules)) / sum(map(len, picked))
    return {"modules": len(modules), "ptx_mib": sum(map(len, modules)) / 2**20,
            "cpu_s": cpu * scale, "sass_mib": sass * scale / 2**20, "measured": len(picked)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", type=int, default=4,
                        help="PTX modules compiled per extension (spread over the sizes)")
    parser.add_argument("--all", action="store_true", help="compile every JIT-only module")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sm121-bench-plan-") as tmp:
        work = Path(tmp)
        package, files = stock_files(work / "wheel")
        source, commit = source_repo(work)
        tag = build_image(package, commit)
        seconds, report = plan(tag, source, work)
        decision = report["decision"]
        assert isinstance(decision, dict)
        print(f"plan of {tag} (vLLM {VERSION} aarch64 wheel): {seconds:.1f} s\n")
        print(f"{'extension':40} {'plan':5} {'native':>13} {'JIT':>11} {'none':>11}")
        totals = {"before": 0, "after": 0}
        for name, item in sorted(decision["extensions"].items()):
            b, a = item["before"], item["after"]
            totals["before"] += b["native"]
            totals["after"] += a["native"]
            print(f"{name:40} {'build' if item['build'] else 'keep':5} "
                  f"{b['native']:>5} -> {a['native']:<5} {b['jit']:>4} -> {a['jit']:<4} "
                  f"{b['none']:>4} -> {a['none']:<4}")
        print(f"\nkernels native on sm_121: {totals['before']} stock -> {totals['after']} "
              f"planned ({totals['after'] - totals['before']} more)\n")
        print("JIT work the plan removes (ptxas 13.0 for sm_121, as the driver would):")
        removed = {"cpu_s": 0.0, "sass_mib": 0.0}
        for name in decision["chosen"]:
            got = jit_removed(name, files[name], None if args.all else args.sample, work)
            removed["cpu_s"] += got["cpu_s"]
            removed["sass_mib"] += got["sass_mib"]
            print(f"  {name:38} {got['modules']:>3} PTX modules ({got['ptx_mib']:.0f} MiB), "
                  f"{got['cpu_s']:.0f} CPU-s, {got['sass_mib']:.0f} MiB SASS "
                  f"({got['measured']} measured)")
        print(f"  stock: {removed['cpu_s']:.0f} CPU-s of JIT and {removed['sass_mib']:.0f} MiB "
              "of SASS at first use (driver JIT cache: 256 MiB by default); planned: 0, 0")
        print("\ncompile cost of the planned rebuild (real builds, 16 jobs):")
        for name in decision["chosen"]:
            target = extension_target(name)
            cost = COMPILE_S.get(target)
            print(f"  {target:38} " + (f"~{cost[0]:.0f} s ({cost[1]})" if cost else
                                       "not measured here"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
