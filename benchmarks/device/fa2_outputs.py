"""Run vLLM FA2's varlen_fwd on fixed random inputs and save the outputs (device proof of
`sm121-build aot`): `python3 fa2_outputs.py SO OUT.pt`.  The configs are those of
shared/device/fa2_jit.py; the first call of each is timed (the driver's JIT when the file has
no cubin for this GPU).  Exit 3 when the library cannot run a kernel (CUDA_DISABLE_PTX_JIT=1
on a JIT-only file)."""
import json
import math
import sys
import time

import torch

CONFIGS = [(torch.bfloat16, 128, True), (torch.bfloat16, 128, False), (torch.float16, 64, True),
           (torch.bfloat16, 256, True), (torch.bfloat16, 96, True)]


def args_for(schema, q, k, v, cu, length, d, causal):
    values = []
    for a in schema.arguments:
        n, ty = a.name, str(a.type)
        if n in ("q", "k", "v"):
            values.append({"q": q, "k": k, "v": v}[n])
        elif n in ("cu_seqlens_q", "cu_seqlens_k"):
            values.append(cu)
        elif n.startswith("max_seqlen"):
            values.append(length)
        elif n == "softmax_scale":
            values.append(1.0 / math.sqrt(d))
        elif n == "is_causal":
            values.append(causal)
        elif "window" in n:
            values.append(-1)
        elif ty.startswith("Optional[") or ty.endswith("?"):
            values.append(None)
        elif ty == "float":
            values.append(0.0)
        elif ty == "bool":
            values.append(False)
        elif ty == "int":
            values.append(0)
        elif ty == "Tensor" and n == "out":
            values.append(torch.empty_like(q))
        else:
            raise SystemExit(f"unknown arg {n}: {ty}")
    return values


def main() -> None:
    so, out = sys.argv[1], sys.argv[2]
    torch.ops.load_library(so)
    op = torch.ops._vllm_fa2_C.varlen_fwd
    saved = {}
    gen = torch.Generator(device="cuda").manual_seed(121)
    for dtype, d, causal in CONFIGS:
        length, heads = 1024, 16
        q, k, v = (torch.randn(length, heads, d, device="cuda", dtype=dtype, generator=gen)
                   for _ in range(3))
        cu = torch.tensor([0, length], device="cuda", dtype=torch.int32)
        values = args_for(op.default._schema, q, k, v, cu, length, d, causal)
        torch.cuda.synchronize()
        t = time.time()
        try:
            result = op(*values)
            torch.cuda.synchronize()
        except RuntimeError as exc:
            print(json.dumps({"config": f"{dtype} d{d} causal={causal}",
                              "error": str(exc).splitlines()[0][:200]}), flush=True)
            sys.exit(3)
        first = time.time() - t
        o = result[0] if isinstance(result, (list, tuple)) else result
        saved[f"{dtype}-{d}-{causal}"] = o.cpu()
        print(json.dumps({"config": f"{dtype} d{d} causal={causal}", "first_s": round(first, 4)}),
              flush=True)
    torch.save(saved, out)


if __name__ == "__main__":
    main()
