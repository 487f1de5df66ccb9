"""Build vLLM's real _C/_moe_C for sm_121 from a release's sources, air-gapped, and measure it.

Runs on any machine with nvcc >= 13.0, cmake >= 3.26, ninja and a CUDA build of torch (the
GPU need not be sm_121: nothing is launched).  Elsewhere it prints why it skips and exits 0.

    python benchmarks/real_build.py --sdist vllm-0.17.0.tar.gz \
        --cutlass nvidia_cutlass-4.2.0.0-py3-none-any.whl --work /tmp/rb --report OUT

Steps, each timed and written to OUT/report.json:
  1. unpack the sources; evaluate the FP4 guards for the arch (cmake -P, the source's own
     cmake/utils.cmake);
  2. unpatched probe (--probe-unpatched): configure, then compile only the FP4 objects, which
     ptxas rejects for plain sm_12x when a guard lets them in;
  3. the patch set, then the build script (`--offline --cutlass`) for the targets, with the
     compile time and the peak memory of the whole process tree;
  4. a second build from an empty build folder with the ccache the first one filled
     (--ccache-rebuild; needs ccache on PATH);
  5. the project's reader on the results: cubins per arch, kernels native on sm_121, the
     kernel names (OUT/kernels-<so>.json, to compare with a stock wheel elsewhere);
  6. torch.ops.load_library of each .so in a fresh process, and the ABI check against the
     torch/lib libraries of that torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm121_build.cuda.binary import DEFAULT_POLICY, Policy, audit_binary  # noqa: E402
from sm121_build.cuda.compat import (  # noqa: E402
    DEFAULT_TARGET,
    ArchList,
    parse_target,
)
from sm121_build.jobs.payload.build_extensions import PTXAS_FP4  # noqa: E402
from sm121_build.source.guard_rules import (  # noqa: E402
    PatchFor,
    apply_all,
    apply_macros,
    breaks_ptxas,
    covered,
    read_source_version,
)
from sm121_build.source.guards import effective_archs, evaluate, find_cmake  # noqa: E402
from sm121_build.verify.checks import check_abi, torch_exports  # noqa: E402

LOAD_SNIPPET = """
import json, sys, torch
torch.ops.load_library(sys.argv[1])
names = [n for n in ("rms_norm", "silu_and_mul", "topk_softmax", "moe_align_block_size",
                     "cutlass_scaled_mm", "cutlass_scaled_fp4_mm", "scaled_fp4_quant",
                     "fwd", "varlen_fwd", "fwd_kvcache")
         if hasattr(getattr(torch.ops, sys.argv[2]), n)]
print(json.dumps({"loaded": True, "torch": torch.__version__, "ops_found": names}))
"""


def skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.version.cuda:
        return f"torch {torch.__version__} is not a CUDA build"
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (home / "bin" / "nvcc").exists():
        return f"no nvcc under {home} (set CUDA_HOME)"
    return None


class PeakMemory:
    """Peak summed RSS of a process tree, sampled twice a second (psutil when present)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                total = root.memory_info().rss + sum(
                    c.memory_info().rss for c in root.children(recursive=True)
                    if c.is_running())
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            self._stop.wait(0.5)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_timed(args: list[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    start = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        memory = PeakMemory(process.pid)
        code = process.wait()
    return {"rc": code, "seconds": round(time.monotonic() - start, 1),
            "peak_rss_gib": round(memory.stop() / 2**30, 2), "log": str(log)}


def build_env(arch: str, jobs: int) -> dict[str, str]:
    import torch

    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return {**os.environ, "TORCH_CUDA_ARCH_LIST": arch, "CUDA_HOME": home,
            "CMAKE_CUDA_COMPILER": f"{home}/bin/nvcc", "MAX_JOBS": str(jobs),
            "NVCC_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
                str(ROOT), os.environ.get("PYTHONPATH")])),
            "CCACHE_DIR": os.environ.get("CCACHE_DIR", "/tmp/sm121-ccache"),
            "TORCH_VERSION_SEEN": torch.__version__}


def script(source: Path, build: Path, out: Path, targets: list[str], cutlass: Path,
           extra: list[str]) -> list[str]:
    args = [sys.executable, "-m", "sm121_build.jobs.payload.build_extensions",
            "--source", str(source), "--out", str(out), "--build-dir", str(build),
            "--offline", "--cutlass", str(cutlass), "--cmake", find_cmake()]
    for target in targets:
        args += ["--target", target]
    return args + extra


def fp4_objects(build: Path) -> list[str]:
    text = (build / "build.ninja").read_text()
    return sorted(set(re.findall(r"^build (\S*fp4\S*\.cu\.o):", text, re.M)))


def fp4_guards(source: Path, arch: str) -> list[dict[str, Any]]:
    return [{"file": g.file, "line": g.line, "var": g.variable, "branch": g.branch,
             "yields": list(g.targets), "taken": g.taken, "breaks_ptxas": breaks_ptxas(g)}
            for g in evaluate(source, ArchList.parse(arch)) if covered(g)]


def unpack(sdist: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (top,) = [p for p in dest.iterdir() if p.is_dir()]
    return top


def version_of(source: Path, sdist: Path) -> str:
    return read_source_version(source) or re.sub(r"^vllm-|(-build)?\.tar\.(gz|xz)$", "",
                                                 sdist.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", type=Path, required=True)
    parser.add_argument("--cutlass", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--arch", default="12.1")
    parser.add_argument("--gpu", default="sm_121",
                        help="the GPU the same-PTX SASS rule and the audit are for (sm_90 on a "
                        "Hopper stand-in for the JIT equivalence check)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    parser.add_argument("--target", action="append", dest="targets")
    parser.add_argument("--probe-unpatched", action="store_true")
    parser.add_argument("--ccache-rebuild", action="store_true")
    parser.add_argument("--flash-attn", type=Path, metavar="TAR",
                        help="flash-attention sources (the commit the vLLM source pins, with "
                        "csrc/cutlass) as a tarball: its rules are applied and it is built "
                        "as VLLM_FLASH_ATTN_SRC_DIR (e.g. --target _vllm_fa2_C)")
    args = parser.parse_args()
    targets = args.targets or ["_C", "_moe_C"]
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    args.report.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"sdist": args.sdist.name, "arch": args.arch, "jobs": args.jobs,
                              "targets": targets, "cpus": os.cpu_count()}

    def save() -> None:
        (args.report / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    source = unpack(args.sdist, args.work / "src")
    version = version_of(source, args.sdist)
    report["version"] = version
    arch = ArchList.parse(args.arch).cmake
    report["guards_before"] = fp4_guards(source, arch)
    env = build_env(arch, args.jobs)
    if not os.environ.get("QUTLASS_SRC_DIR"):
        # QuTLASS comes from GitHub; offline, the build script compiles empty stand-ins.
        report["qutlass"] = "stand-in (empty sources): QuTLASS kernels not built"
    report["torch"] = env.pop("TORCH_VERSION_SEEN")
    save()

    if args.probe_unpatched:
        probe = args.work / "probe"
        configured = run_timed(script(source, probe, args.work / "probe-out", [], args.cutlass,
                                      ["--configure-only"]), args.report / "probe.log", env)
        objects = fp4_objects(probe) if configured["rc"] == 0 else []
        result = (run_timed(["ninja", "-C", str(probe), "-k", "0", *objects],
                            args.report / "probe-compile.log", env) if objects else {})
        text = Path(result["log"]).read_text(errors="replace") if result else ""
        match = PTXAS_FP4.search(text)
        report["unpatched_probe"] = {"configure": configured, "fp4_objects": len(objects),
                                     "compile": result,
                                     "ptxas_message": match.group(0) if match else None}
        save()

    gpu = parse_target(args.gpu)
    policy = Policy(gpu, DEFAULT_POLICY.driver)
    report["gpu"] = str(gpu)
    report["patch"] = [{"set": r.name, "outcome": r.outcome, "replacements": r.replacements}
                       for r in apply_all(source, PatchFor(version, ArchList.parse(arch)))]
    report["patch"] += [{"set": r.name, "outcome": r.outcome, "detail": r.detail}
                        for r in apply_macros(source, "vllm",
                                              effective_archs(source, ArchList.parse(arch)), gpu)]
    report["guards_after"] = fp4_guards(source, arch)
    if args.flash_attn:
        flash = unpack(args.flash_attn, args.work / "flash-attn")
        handed = effective_archs(source, ArchList.parse(arch))
        results = apply_all(flash,
                PatchFor(version, handed, gpu=DEFAULT_TARGET), project="vllm-flash-attn")
        report["flash_attn"] = {"cuda_archs_from_vllm": str(handed), "rules": [
            {"set": r.name, "outcome": r.outcome, "detail": r.detail, "rewrites": [
                {"at": w.guard.location, "list": w.new_list, "gives": list(w.result)}
                for w in r.rewrites]} for r in results]}
        report["flash_attn"]["rules"] += [
            {"set": r.name, "outcome": r.outcome, "detail": r.detail}
            for r in apply_macros(flash, "vllm-flash-attn", handed, gpu)]
        env["VLLM_FLASH_ATTN_SRC_DIR"] = str(flash)
    save()

    out = args.work / "out"
    first = run_timed(script(source, args.work / "build", out, targets, args.cutlass, []),
                      args.report / "build.log", env)
    report["build"] = first
    save()
    if first["rc"] != 0:
        return 1
    if args.ccache_rebuild and shutil.which("ccache"):
        shutil.rmtree(args.work / "build")
        report["ccache_rebuild"] = run_timed(
            script(source, args.work / "build", args.work / "out2", targets, args.cutlass, []),
            args.report / "build2.log", env)
        stats = subprocess.run(["ccache", "-s"], capture_output=True, text=True, env=env)
        report["ccache_stats"] = stats.stdout.strip().splitlines()
        save()

    import torch

    libs = sorted(Path(torch.__file__).parent.joinpath("lib").glob("lib*.so*"))
    files = {p.name: p for p in sorted(out.glob("*.so"))}
    abi = check_abi(files, torch_exports(libs), len(libs))
    report["abi"] = {"torch_symbols_checked": abi.checked,
                     "problems": abi.problems()}
    report["binaries"] = {}
    for name, path in files.items():
        audit = audit_binary(path, name, policy, with_kernels=True)
        kernels = audit.kernels or {}
        (args.report / f"kernels-{name}.json").write_text(json.dumps(sorted(
            k for k, v in kernels.items() if v == "native")))
        # 0.2x: _C_stable_libtorch registers torch.ops._C, _moe_C_stable_libtorch ._moe_C
        namespace = name.split(".")[0].removesuffix("_stable_libtorch")
        loaded = subprocess.run([sys.executable, "-c", LOAD_SNIPPET, str(path), namespace],
                                capture_output=True, text=True)
        report["binaries"][name] = {
            "size_mib": round(path.stat().st_size / 2**20, 1),
            "cubins": audit.arch_counts("elf"), "ptx": audit.arch_counts("ptx"),
            "kernels": audit.kernel_counts(),
            "load_library": json.loads(loaded.stdout) if loaded.returncode == 0 else
            {"loaded": False, "error": loaded.stderr.strip().splitlines()[-1:]},
        }
        save()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
