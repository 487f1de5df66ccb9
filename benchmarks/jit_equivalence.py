"""Same-PTX SASS (the sass-from-ptx rule) against the driver's JIT of that very PTX, on a GPU.

    python benchmarks/jit_equivalence.py BUILT_FA2_SO --out DIR

BUILT_FA2_SO is a `_vllm_fa2_C` built with the rule rendered for the GPU at hand (a Hopper
stands in for GB10: it cannot load sm_80 cubins either, so the stock FA2 JIT-compiles its
compute_80 PTX there exactly as on a Spark).  The JIT side is the same file with the rule's
SASS hidden: the arch field of every fatbin cubin entry for this GPU is set to an arch it
cannot load (sm_<gpu+10>), so the driver falls back to the compute_80 PTX, which is what it
does for the stock file.  Both run in fresh processes (JIT cache disabled) on the same seeded
inputs; prints first-call times and the element-wise comparison (bitwise equal expected:
the same PTX through ptxas ahead of time vs through the driver's compiler).
Needs torch with CUDA and a GPU; nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm121_build.cuda.fatbin import (  # noqa: E402
    CONTAINER_HEADER,
    CONTAINER_MAGIC,
    ENTRY_HEADER,
    ENTRY_MIN_HEADER,
    code_sections,
)

ARCH_FIELD = 28  # offset of `arch` in a fatbin entry header ("<HHIQIIHHI…")
CONFIGS = [("bfloat16", 128, True), ("bfloat16", 128, False), ("float16", 64, True),
           ("bfloat16", 256, True)]


def hide_sass(src: Path, dst: Path, arch: int) -> int:
    """Copy `src` with every cubin entry for sm_<arch> renamed to sm_<arch+10>; the count."""
    shutil.copy2(src, dst)
    hidden = 0
    with open(dst, "r+b") as handle, mmap.mmap(handle.fileno(), 0) as data:
        for start, length in [(c.start, c.length) for c in code_sections(dst, data) if c.strict]:
            pos, end = start, start + length
            while pos + CONTAINER_HEADER.size <= end:
                magic, _v, header, size = CONTAINER_HEADER.unpack_from(data, pos)
                if magic != CONTAINER_MAGIC:
                    pos += 8
                    continue
                body, body_end = pos + header, pos + header + size
                while body + ENTRY_MIN_HEADER <= body_end:
                    fields = ENTRY_HEADER.unpack_from(data, body)
                    kind, entry_header, payload = fields[0], fields[2], fields[3]
                    if kind == 0 and entry_header == 0:
                        break
                    if kind == 2 and fields[8] == arch:  # 2: an ELF (cubin) entry
                        data[body + ARCH_FIELD:body + ARCH_FIELD + 4] = \
                            (arch + 10).to_bytes(4, "little")
                        hidden += 1
                    body += entry_header + payload
                pos = body_end
        data.flush()
    return hidden


WORKER = r"""
import json, math, sys, time, torch
so, out = sys.argv[1], sys.argv[2]
torch.ops.load_library(so)
op = torch.ops._vllm_fa2_C.varlen_fwd
schema = op.default._schema
def args_for(q, k, v, cu, L, d, causal):
    vals = []
    for a in schema.arguments:
        n, ty = a.name, str(a.type)
        if n in ("q", "k", "v"): vals.append({"q": q, "k": k, "v": v}[n])
        elif n in ("cu_seqlens_q", "cu_seqlens_k"): vals.append(cu)
        elif n.startswith("max_seqlen"): vals.append(L)
        elif n == "softmax_scale": vals.append(1.0 / math.sqrt(d))
        elif n == "is_causal": vals.append(causal)
        elif "window" in n: vals.append(-1)
        elif ty.startswith("Optional[") or ty.endswith("?"): vals.append(None)
        elif ty == "float": vals.append(0.0)
        elif ty == "bool": vals.append(False)
        elif ty == "int": vals.append(0)
        elif ty == "Tensor" and n == "out": vals.append(torch.empty_like(q))
        else: raise SystemExit(f"unknown argument {n}: {ty}")
    return vals
results, outputs = [], {}
for dtype, d, causal in json.loads(sys.argv[3]):
    gen = torch.Generator().manual_seed(1234 + d)
    L, h = 1024, 16
    q, k, v = (torch.randn(L, h, d, generator=gen).to(getattr(torch, dtype)).cuda()
               for _ in range(3))
    cu = torch.tensor([0, 384, L], dtype=torch.int32).cuda()
    a = args_for(q, k, v, cu, 640, d, causal)
    torch.cuda.synchronize()
    t = time.time(); o = op(*a); torch.cuda.synchronize(); first = time.time() - t
    t = time.time(); o = op(*a); torch.cuda.synchronize(); second = time.time() - t
    o = o[0] if isinstance(o, (list, tuple)) else o
    outputs[f"{dtype}-{d}-{causal}"] = o.cpu()
    results.append({"config": f"{dtype} d{d} {'causal' if causal else 'full'}",
                    "first_s": round(first, 3), "second_ms": round(second * 1e3, 3)})
torch.save(outputs, out)
print(json.dumps(results))
"""


def run(so: Path, out: Path) -> list[dict[str, object]]:
    env = {**os.environ, "CUDA_CACHE_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-c", WORKER, str(so), str(out),
                             json.dumps(CONFIGS)], capture_output=True, text=True, env=env,
                            check=False)
    if result.returncode != 0:
        raise SystemExit(f"{so}: {result.stderr[-3000:]}")
    parsed: list[dict[str, object]] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("built", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    args.out.mkdir(parents=True, exist_ok=True)
    jit_so = args.out / "fa2-sass-hidden.so"
    hidden = hide_sass(args.built, jit_so, arch)
    print(f"GPU {torch.cuda.get_device_name()} (sm_{arch}); {hidden} sm_{arch} cubin entries "
          "hidden in the JIT copy", flush=True)
    aot = run(args.built, args.out / "aot.pt")
    jit = run(jit_so, args.out / "jit.pt")
    a, j = torch.load(args.out / "aot.pt"), torch.load(args.out / "jit.pt")
    report = []
    for (key, x), timing_aot, timing_jit in zip(a.items(), aot, jit, strict=True):
        y = j[key]
        diff = (x.float() - y.float()).abs().max().item()
        row = {"config": timing_aot["config"], "bitwise_equal": bool(torch.equal(x, y)),
               "max_abs_diff": diff, "first_call_s_aot": timing_aot["first_s"],
               "first_call_s_jit": timing_jit["first_s"],
               "second_call_ms_aot": timing_aot["second_ms"],
               "second_call_ms_jit": timing_jit["second_ms"],
               "finite": bool(torch.isfinite(x.float()).all())}
        report.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "equivalence.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "arch": arch, "hidden_entries": hidden,
         "torch": torch.__version__, "rows": report}, indent=2))
    return 0 if all(r["bitwise_equal"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
