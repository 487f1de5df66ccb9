"""Device step 1 (repo root as cwd): vLLM 0.33.0 sources patched as benchmarks/real_build.py
patches them with `--arch 12.1 --gpu sm_90` (apply_all for 12.1, then apply_macros rendered for
sm_90: the sass-from-ptx rule gives PTX-only sources `compute_XY,code=sm_90`), configured with
the project's build script (build_extensions --offline --cutlass --configure-only, env from
real_build.build_env("12.1"), so TORCH_CUDA_ARCH_LIST=12.1 whatever the image exports), then
ONLY the two Marlin repack objects compiled with ninja.  Writes EQC/build.json, EQC/objs/*.o."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_build as rb  # noqa: E402

from sm121_build.source.guards import cmake_arch_list, effective_archs  # noqa: E402
from sm121_build.source.guard_rules import apply_all, apply_macros  # noqa: E402
from sm121_build.verify.compat import parse_target  # noqa: E402

SDIST = ROOT / ".devbuild/vllm-0.33.0-build.tar.xz"
CUTLASS = Path("/tmp/cutlass-v4.7.0")
W = Path("/tmp/eqw")
EQC = Path(os.environ.get("EQC", "/tmp/eqcrun"))
TARGET = "_C_stable_libtorch"
OBJS = {f: f"CMakeFiles/{TARGET}.dir/csrc/quantization/marlin/{f}_marlin_repack.cu.o"
        for f in ("gptq", "awq")}
T0 = time.time()
rep: dict = {}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def save() -> None:
    (EQC / "build.json").write_text(json.dumps(rep, indent=2) + "\n")


def sh(cmd: str) -> str:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


def main() -> int:
    EQC.mkdir(parents=True, exist_ok=True)
    (EQC / "objs").mkdir(exist_ok=True)
    rep["tools"] = {"nvcc": sh("nvcc --version | tail -2"),
                    "driver": sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader"),
                    "cmake": sh("cmake --version | head -1"), "ninja": sh("ninja --version"),
                    "image_TORCH_CUDA_ARCH_LIST": os.environ.get("EQC_IMAGE_ARCH_LIST"),
                    "exported_TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    if W.exists():
        shutil.rmtree(W)
    source = rb.unpack(SDIST, W / "src")
    version = rb.version_of(source, SDIST)
    arch = cmake_arch_list("12.1")
    eff = effective_archs(source, arch)
    gpu = parse_target("sm_90")
    patch = [{"set": r.name, "outcome": r.outcome, "replacements": r.replacements}
             for r in apply_all(source, version, arch)]
    patch += [{"set": r.name, "outcome": r.outcome, "detail": r.detail}
              for r in apply_macros(source, "vllm", eff, gpu)]
    rep.update(version=version, arch=arch, effective=eff, gpu=str(gpu), patch=patch)
    log(f"patched: {patch}")
    env = rb.build_env(arch, 16)
    rep["torch"] = env.pop("TORCH_VERSION_SEEN")
    rep["env_TORCH_CUDA_ARCH_LIST"] = env["TORCH_CUDA_ARCH_LIST"]
    save()
    build = W / "build"
    rep["configure"] = rb.run_timed(rb.script(source, build, W / "out", [TARGET], CUTLASS,
                                              ["--configure-only"]), EQC / "configure.log", env)
    log(f"configure: {rep['configure']}")
    save()
    if rep["configure"]["rc"] != 0:
        return 1
    conf = (EQC / "configure.log").read_text(errors="replace")
    rep["configure_lines"] = [l for l in conf.splitlines()
                              if re.search(r"CUDA target arch|supported|Marlin", l)][:12]
    text = (build / "build.ninja").read_text()
    rep["objects"] = {}
    for fam, obj in OBJS.items():
        i = text.index(f"\nbuild {obj}:")
        block = text[i + 1:].split("\n\n", 1)[0]
        flags = re.search(r"\n\s+FLAGS = (.*)", block).group(1)
        gen = re.findall(r"-gencode arch=\S+", flags)
        rep["objects"][fam] = {"object": obj, "gencode": gen,
                               "has_rule_flag": "-gencode arch=compute_80,code=sm_90" in gen}
        (EQC / f"{fam}-build-ninja.txt").write_text(block + "\n")
    log(f"gencodes: { {k: v['gencode'] for k, v in rep['objects'].items()} }")
    save()
    t = time.monotonic()
    r = subprocess.run(["ninja", "-C", str(build), "-j", "2", *OBJS.values()], env=env,
                       capture_output=True, text=True)
    rep["compile"] = {"rc": r.returncode, "wall_s": round(time.monotonic() - t, 1),
                      "command": f"ninja -C {build} -j 2 " + " ".join(OBJS.values())}
    (EQC / "compile.log").write_text(r.stdout + r.stderr)
    try:
        for line in (build / ".ninja_log").read_text().splitlines()[1:]:
            start, end, _m, out = line.split("\t")[:4]
            for fam, obj in OBJS.items():
                if out == obj:
                    rep["objects"][fam]["compile_s"] = (int(end) - int(start)) / 1000
    except Exception as exc:  # noqa: BLE001
        rep["ninja_log_error"] = repr(exc)
    for fam, obj in OBJS.items():
        cmd = sh(f"ninja -C {build} -t commands {obj} | tail -1")
        (EQC / f"{fam}-nvcc-command.txt").write_text(cmd + "\n")
        o = build / obj
        if o.exists():
            shutil.copy2(o, EQC / "objs" / f"{fam}_marlin_repack.cu.o")
            rep["objects"][fam]["bytes"] = o.stat().st_size
            rep["objects"][fam]["cuobjdump"] = sh(f"cuobjdump -lelf -lptx {o}")
    log(f"compile: {rep['compile']} {[(k, v.get('compile_s')) for k, v in rep['objects'].items()]}")
    save()
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
