"""FAKE stand-ins for a GPU, at the boundaries a CPU machine cannot cross: an interpreter
that answers as prove's payloads answer on a GB10, and the CLI with the engine's GPU request
taken out.  Neither is a proof of anything: the real payloads run only on a GPU
(benchmarks/device/prove_run.sh)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# FAKE: stands in for `--python`.  It is given the payload script and its arguments, and
# prints what that script prints on a GPU (FAKE_MODE picks a story); it never loads a cubin
# nor runs a kernel.  The device (sm_121, a GB10) and every number are made up.
FAKE_PYTHON = '''
import json, os, sys
from pathlib import Path
mode = os.environ.get("FAKE_MODE", "proven")
script, args = Path(sys.argv[1]).name, sys.argv[2:]
jit = os.environ.get("CUDA_DISABLE_PTX_JIT") != "1"
# the driver's cache is off, but for a JIT run given the run's own fresh cache folder
cache = os.environ.get("CUDA_CACHE_PATH")
assert (os.environ.get("CUDA_CACHE_DISABLE") == "1" and cache is None) or (
    jit and cache and Path(cache).is_dir() and os.environ.get("CUDA_CACHE_DISABLE") in (None, "0"))
def say(**data): print(json.dumps(data), flush=True)
if script == "load_cubins.py":
    if mode == "no-gpu":
        say(error="cuInit: CUDA_ERROR_NO_DEVICE"); sys.exit(3)
    major, minor = (9, 0) if mode == "hopper" else (12, 1)
    print("a line that is not JSON")
    sizes = {} if mode == "no-sizes" else json.loads(os.environ.get("FAKE_SIZES", "null")) or \
        {"smem_block": 101376, "smem_sm": 102400, "sms": 48}  # a lying loader's, if given
    say(device={"name": "FAKE GB10", "major": major, "minor": minor, "driver": 13000,
                "version": "580.95.05", **sizes})
    if args[0] == "load":
        items = json.loads(Path(args[1]).read_text())
        for n, item in enumerate(items):
            if mode == "missing" and n == 0:
                say(cubin=item["id"], loaded=True, found=len(item["kernels"]) - 1,
                    missing=item["kernels"][:1], missing_count=1)
            elif mode == "unloadable" and n == 0:
                say(cubin=item["id"], loaded=False, error="CUDA_ERROR_INVALID_IMAGE")
            else:
                say(cubin=item["id"], loaded=True, missing=[], missing_count=0,
                    found=2**31 - 1 if mode == "hugecount" else len(item["kernels"]))
        say(done=len(items))
elif script.startswith("harness_"):
    so, out = args[:2]
    # the native run is given the file's added kernels (KERNELS.json): FAKE_LAUNCHED says
    # which of them its recorder reports launched: all, half, none, or a hostile flood;
    # a harness given --cases also says each of them (after its fixed cases, unless
    # --derived-only)
    rest = args[2:]
    kernels = json.loads(Path(rest.pop(0)).read_text()) if rest[:1] and \
        not rest[0].startswith("--") else None
    derived = [c["key"] for c in json.loads(Path(rest[1]).read_text())["cases"]] \
        if rest[:1] == ["--cases"] else []
    # its two fixed cases, or those of them at the positions --fixed gives (dealt by prove
    # with their modules: the real FA2 harness has 8, positions past this one's 2 are
    # none of its), none with --derived-only
    at = rest[rest.index("--fixed") + 1].split(",") if "--fixed" in rest else ["0", "1"]
    fixed_cases = [] if "--derived-only" in rest else \
        [("gptq-4bit-256x192", "awq-8bit-7168x2112")[int(i)] for i in at if int(i) < 2]
    launched = os.environ.get("FAKE_LAUNCHED", "all")
    stock = "/stock/" in so
    if mode == "schema":
        say(schema_error="_C.gptq_marlin_repack has no argument size_k"); sys.exit(4)
    if stock and not jit and mode != "stock-runs":
        say(op="gptq_marlin_repack", case="gptq-4bit-256x192",
            error="CUDA error: PTX JIT compilation was disabled"); sys.exit(3)
    for case in [*fixed_cases, *derived]:
        if mode == "prefixed":  # a library's printf before each line: none of them parses
            print("[W] ", end="")
        say(op="gptq_marlin_repack", case=case, first_s=2.5 if jit else 0.001)
        key = "gptq_marlin_repack/" + case
        if kernels is None or not case.startswith("gptq"):
            continue
        if launched == "broken":
            say(recorder="the profiler could not start: CUPTI_ERROR_NOT_INITIALIZED")
            continue
        if launched == "hostile":  # names not the file's, escapes, repeats, wrong types
            for n in range(30000):
                say(launched="_Z%dtorch_own_kernelv" % n, case=key)
            say(launched="\u001b]0;owned\u0007", case=key)
            say(launched=kernels[0], case="not_an_op/not-a-case")
            say(launched=["a list"], case=key)
            say(launched=kernels[0] * 5000, case=key)
            for n in range(100):
                say(launched=kernels[0], case=key)
        mine = {"all": kernels, "half": kernels[:len(kernels) // 2]}.get(launched, [])
        for kernel in mine:
            say(launched=kernel, case=key)
    cases = [*fixed_cases, *derived]
    Path(out).write_text(json.dumps(cases))  # (what compare_outputs.py, FAKE, reads)
    say(saved=len(cases))
elif script == "compare_outputs.py":
    for case in [c for path in args[0::2] for c in json.loads(Path(path).read_text())]:
        # FAKE_DIFFERS: the case that differs (by prefix; awq's launches no added kernel)
        differs = mode == "differs" and case.startswith(os.environ.get("FAKE_DIFFERS", "awq"))
        say(key="gptq_marlin_repack/" + case, bitwise_equal=not differs,
            max_abs_diff=3.0 if differs else 0.0, max_ulp=12 if differs else 0)
else:
    sys.exit(f"FAKE: unknown payload {script}")
'''


def fake_python(path: Path, interpreter: str) -> Path:
    """The FAKE interpreter at `path`, run by `interpreter` (its `#!` line): executable."""
    path.write_text(f"#!{interpreter}\n" + FAKE_PYTHON)
    path.chmod(0o755)
    return path


# the CLI (`python -m devkit.fake_gpu ARGS`) with the engine's device request taken out: the
# containers `prove IMAGE` runs get no GPU, and each time the engine is asked for one a line
# is added to $FAKE_GPU_REQUESTS (so a test sees that every child asked)
def _no_gpu_request() -> None:
    import os
    import runpy
    import sys

    from sm121_build.image.engine import Engine

    def gpu_devices(self: Engine) -> list[object]:
        with open(os.environ["FAKE_GPU_REQUESTS"], "a") as log:
            log.write("gpu requested\n")
        return []

    Engine.gpu_devices = gpu_devices  # type: ignore[method-assign,assignment]
    sys.argv = ["sm121-build", *sys.argv[1:]]
    runpy.run_module("sm121_build", run_name="__main__")


if __name__ == "__main__":
    _no_gpu_request()


def covered(data: dict[str, Any], never: Mapping[str, list[str]] | None = None
            ) -> dict[str, Any]:
    """FAKE: a format-2 proof (made before coverage was measured: the real H200's) as a
    format-3 one, its coverage made up: each file's added kernels its cubins' count, every
    one launched and compared but those `never` names (file -> names never launched),
    and the verdict that follows.  Made up: no GPU said which kernels ran."""
    data = json.loads(json.dumps(data))
    data["format"] = 3
    totals = dict.fromkeys(("added", "launched", "compared", "never_launched",
                            "unreachable"), 0)
    for item in data["files"]:
        added = sum(c["kernels"] for c in item["cubins"])
        names = (never or {}).get(item["name"], [])
        for cubin in item["cubins"]:
            cubin["launched"] = cubin["kernels"]
        item["coverage"] = {"added": added, "launched": added - len(names),
                            "compared": added - len(names), "never_launched": names,
                            "unreachable": [], "recorder": None}
        for key in ("added", "launched", "compared"):
            totals[key] += item["coverage"][key]
        totals["never_launched"] += len(names)
    data["coverage"] = totals
    if data["verdict"] == "proven" and totals["never_launched"]:
        data["verdict"] = "partial"
    return data
