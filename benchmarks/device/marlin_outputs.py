"""Run vLLM `_C`'s Marlin GPTQ/AWQ repack ops on fixed random inputs and save the outputs
(device proof of `sm121-build aot` on a `_C` family): `python3 marlin_outputs.py SO OUT.pt`.
Exit 3 when a kernel cannot run (CUDA_DISABLE_PTX_JIT=1 on a file the GPU can only JIT)."""
import json
import sys
import time

import torch

SHAPES = [(256, 192), (4096, 4096), (7168, 2112)]  # (size_k, size_n)


def call(op, values: dict):
    """The op with its arguments by schema name (vLLM renames none of these across 0.2x)."""
    args = [values[a.name] for a in op.default._schema.arguments]
    return op(*args)


def main() -> None:
    so, out = sys.argv[1], sys.argv[2]
    torch.ops.load_library(so)
    ops = torch.ops._C
    gen = torch.Generator(device="cuda").manual_seed(121)
    saved = {}
    for bits in (4, 8):
        pack = 32 // bits
        for k, n in SHAPES:
            cases = {
                "gptq": (ops.gptq_marlin_repack, (k // pack, n), False),
                "gptq-act-order": (ops.gptq_marlin_repack, (k // pack, n), True),
                "awq": (ops.awq_marlin_repack, (k, n // pack), False),
            }
            for name, (op, shape, act_order) in cases.items():
                q = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device="cuda",
                                  generator=gen)
                perm = (torch.randperm(k, device="cuda", generator=gen).int() if act_order
                        else torch.empty(0, dtype=torch.int32, device="cuda"))
                values = {"b_q_weight": q, "perm": perm, "size_k": k, "size_n": n,
                          "num_bits": bits, "is_a_8bit": False}
                torch.cuda.synchronize()
                t = time.time()
                try:
                    result = call(op, values)
                    torch.cuda.synchronize()
                except RuntimeError as exc:
                    print(json.dumps({"case": name, "error": str(exc).splitlines()[0][:200]}),
                          flush=True)
                    sys.exit(3)
                key = f"{name}-{bits}bit-{k}x{n}"
                saved[key] = result.cpu()
                print(json.dumps({"case": key, "first_s": round(time.time() - t, 4)}),
                      flush=True)
    torch.save(saved, out)


if __name__ == "__main__":
    main()
