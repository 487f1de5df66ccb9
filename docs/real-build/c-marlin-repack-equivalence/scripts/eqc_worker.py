"""One fresh process: load a Marlin repack object's device code through the CUDA driver API
(ctypes, in torch's primary context) in one MODE, run every template on seeded inputs, save
the outputs and the timings.

  python3 eqc_worker.py MODE OBJ FAMILY OUT_PREFIX
MODE: fatbin         the object's whole .nv_fatbin (driver picks: the sm_90 cubin = the rule's SASS)
      fatbin-hidden  the same with the sm_90 cubin entries' arch set to sm_100 (driver JITs the
                     compute_80 PTX, as it does for the stock file, whose only cubins are sm_75/80)
      cubin          the sm_90 cubin entry alone
      ptx            the compute_80 PTX entry alone (cuModuleLoadDataEx = the driver's JIT)
      link           no launch: cuLink* JIT of the PTX for this context's GPU, cubin written out
Run with CUDA_CACHE_DISABLE=1 (the caller does)."""

from __future__ import annotations

import ctypes as C
import json
import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
T_START = time.perf_counter()
mode, obj, family, prefix = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]

from elftools.elf.elffile import ELFFile  # noqa: E402

from sm121_build.verify.fatbin import HostBinary  # noqa: E402

TEMPLATES = [(4, False), (8, False), (4, True), (8, True)]
SHAPES = [(256, 192), (4096, 4096), (7168, 2112), (2048, 13824)]  # (size_k, size_n)
TIMING_ONLY = os.environ.get("EQC_TIMING_ONLY") == "1"  # repeats: first shape only, nothing saved
if TIMING_ONLY:
    SHAPES = SHAPES[:1]
THREADS = 256  # marlin::repack_threads


def kernel_name(nb: int, a8: bool) -> str:
    base = f"{family}_marlin_repack_kernel"
    return f"_ZN6marlin{len(base)}{base}ILi256ELi{nb}ELb{int(a8)}EEEvPKjPjii"


def image() -> tuple[bytes, dict]:
    info: dict = {}
    if mode.startswith("fatbin"):
        with open(obj, "rb") as f:
            data = ELFFile(f).get_section_by_name(".nv_fatbin").data()
        with HostBinary.open(obj) as b:
            info["entries"] = [f"{e.kind}:{e.sm}" for e in b.entries]
        return data, info
    with HostBinary.open(obj) as b:
        want = ("elf", 90) if mode == "cubin" else ("ptx", 80)
        (e,) = [e for e in b.entries if (e.kind, e.arch) == want]
        info["entries"] = [f"{e.kind}:{e.sm}"]
        data = b.payload(e)
    if mode in ("ptx", "link"):
        data = data.rstrip(b"\0") + b"\0"
    return data, info


cu = C.CDLL("libcuda.so.1")


def ck(res: int, what: str) -> None:
    if res != 0:
        s = C.c_char_p()
        cu.cuGetErrorString(res, C.byref(s))
        raise RuntimeError(f"{what}: CUresult {res} {s.value!r}")


cu.cuLaunchKernel.argtypes = [C.c_void_p] + [C.c_uint] * 7 + [C.c_void_p] * 3
cu.cuModuleLoadDataEx.argtypes = [C.POINTER(C.c_void_p), C.c_void_p, C.c_uint,
                                  C.POINTER(C.c_int), C.POINTER(C.c_void_p)]
cu.cuModuleGetFunction.argtypes = [C.POINTER(C.c_void_p), C.c_void_p, C.c_char_p]
cu.cuFuncSetAttribute.argtypes = [C.c_void_p, C.c_int, C.c_int]
cu.cuFuncGetAttribute.argtypes = [C.POINTER(C.c_int), C.c_int, C.c_void_p]
cu.cuLinkCreate_v2.argtypes = [C.c_uint, C.POINTER(C.c_int), C.POINTER(C.c_void_p),
                               C.POINTER(C.c_void_p)]
cu.cuLinkAddData_v2.argtypes = [C.c_void_p, C.c_int, C.c_void_p, C.c_size_t, C.c_char_p,
                                C.c_uint, C.c_void_p, C.c_void_p]
cu.cuLinkComplete.argtypes = [C.c_void_p, C.POINTER(C.c_void_p), C.POINTER(C.c_size_t)]
cu.cuLinkDestroy.argtypes = [C.c_void_p]

CU_JIT_WALL_TIME, CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 2, 3, 4
CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_LOG_VERBOSE = 5, 6, 12


def jit_options():
    info, err = C.create_string_buffer(1 << 16), C.create_string_buffer(1 << 16)
    opts = (C.c_int * 6)(CU_JIT_WALL_TIME, CU_JIT_INFO_LOG_BUFFER,
                         CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, CU_JIT_ERROR_LOG_BUFFER,
                         CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_LOG_VERBOSE)
    vals = (C.c_void_p * 6)(None, C.cast(info, C.c_void_p).value, 1 << 16,
                            C.cast(err, C.c_void_p).value, 1 << 16, 1)
    return opts, vals, info, err


def wall_ms(vals) -> float:
    raw = vals[0] or 0
    return round(struct.unpack("<f", struct.pack("<Q", raw)[:4])[0], 3)


def main() -> None:
    rep: dict = {"mode": mode, "family": family, "object": obj.name}
    data, info = image()
    rep.update(info)
    rep["image_bytes"] = len(data)
    buf = C.create_string_buffer(data, len(data))
    import torch

    t = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    rep["torch_init_s"] = round(time.perf_counter() - t, 3)
    rep["CUDA_MODULE_LOADING"] = os.environ.get("CUDA_MODULE_LOADING")
    rep["CUDA_CACHE_DISABLE"] = os.environ.get("CUDA_CACHE_DISABLE")
    rep["gpu"] = torch.cuda.get_device_name()
    ver = C.c_int()
    ck(cu.cuDriverGetVersion(C.byref(ver)), "cuDriverGetVersion")
    rep["cuDriverGetVersion"] = ver.value
    ctx = C.c_void_p()
    ck(cu.cuCtxGetCurrent(C.byref(ctx)), "cuCtxGetCurrent")
    assert ctx.value, "no current context"
    dev = C.c_int()
    ck(cu.cuCtxGetDevice(C.byref(dev)), "cuCtxGetDevice")
    sms, smem = C.c_int(), C.c_int()
    ck(cu.cuDeviceGetAttribute(C.byref(sms), 16, dev), "SM count")        # MULTIPROCESSOR_COUNT
    ck(cu.cuDeviceGetAttribute(C.byref(smem), 97, dev), "smem optin")     # MAX_SHARED_..._OPTIN
    rep["blocks"], rep["max_shared_mem"] = sms.value, smem.value

    if mode == "link":
        opts, vals, ibuf, ebuf = jit_options()
        state = C.c_void_p()
        t = time.perf_counter()
        ck(cu.cuLinkCreate_v2(6, opts, vals, C.byref(state)), "cuLinkCreate")
        r = cu.cuLinkAddData_v2(state, 1, C.cast(buf, C.c_void_p), len(data), b"repack.ptx",
                                0, None, None)  # 1: CU_JIT_INPUT_PTX
        if r:
            raise RuntimeError(f"cuLinkAddData {r}: {ebuf.value.decode(errors='replace')}")
        out, size = C.c_void_p(), C.c_size_t()
        ck(cu.cuLinkComplete(state, C.byref(out), C.byref(size)), "cuLinkComplete")
        rep["link_s"] = round(time.perf_counter() - t, 3)
        rep["jit_wall_ms"] = wall_ms(vals)
        Path(prefix + ".cubin").write_bytes(C.string_at(out, size.value))
        rep["jit_cubin_bytes"] = size.value
        rep["info_log"] = ibuf.value.decode(errors="replace")
        cu.cuLinkDestroy(state)
        Path(prefix + ".json").write_text(json.dumps(rep, indent=1))
        return

    opts, vals, ibuf, ebuf = jit_options()
    mod = C.c_void_p()
    torch.cuda.synchronize()
    t_load0 = time.perf_counter()
    r = cu.cuModuleLoadDataEx(C.byref(mod), C.cast(buf, C.c_void_p), 6, opts, vals)
    t_load = time.perf_counter() - t_load0
    if r:
        raise RuntimeError(f"cuModuleLoadDataEx {r}: {ebuf.value.decode(errors='replace')}")
    rep["module_load_s"] = round(t_load, 4)
    rep["jit_wall_ms"] = wall_ms(vals)
    rep["info_log"] = ibuf.value.decode(errors="replace")[:4000]
    outputs, rows = {}, []
    first_call_done = False
    for nb, a8 in TEMPLATES:
        name = kernel_name(nb, a8)
        pf = 32 // nb
        fn = C.c_void_p()
        t0 = time.perf_counter()
        ck(cu.cuModuleGetFunction(C.byref(fn), mod, name.encode()), f"get {name}")
        t_get = time.perf_counter() - t0
        ck(cu.cuFuncSetAttribute(fn, 8, smem.value), "set smem")  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        attrs = {}
        for key, a in (("num_regs", 4), ("local_bytes", 3), ("binary_version", 6),
                       ("ptx_version", 5), ("max_threads", 0)):
            v = C.c_int()
            ck(cu.cuFuncGetAttribute(C.byref(v), a, fn), key)
            attrs[key] = v.value
        for si, (k, n) in enumerate(SHAPES):
            gen = torch.Generator().manual_seed(1000 * nb + 100 * int(a8) + si
                                                + (0 if family == "gptq" else 7))
            shape = (k // pf, n) if family == "gptq" else (k, n // pf)
            inp = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32,
                                generator=gen).cuda()
            oshape = (k // 16, n * 16 // pf)
            times, outs = [], []
            for fill in (0, -1):
                o = torch.full(oshape, fill, dtype=torch.int32, device="cuda")
                args = [C.c_uint64(inp.data_ptr()), C.c_uint64(o.data_ptr()), C.c_int(k),
                        C.c_int(n)]
                params = (C.c_void_p * 4)(*[C.cast(C.pointer(x), C.c_void_p) for x in args])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ck(cu.cuLaunchKernel(fn, sms.value, 1, 1, THREADS, 1, 1, smem.value, None,
                                     C.cast(params, C.c_void_p), None), "launch")
                ck(cu.cuCtxSynchronize(), "sync")
                times.append(time.perf_counter() - t0)
                outs.append(o.cpu())
            key = f"{family}:b{nb}:a8={int(a8)}:{k}x{n}"
            outputs[key] = outs[0]
            row = {"config": key, "kernel": name, **attrs,
                   "covered": bool(torch.equal(outs[0], outs[1])),
                   "launch1_ms": round(times[0] * 1e3, 3), "launch2_ms": round(times[1] * 1e3, 3)}
            if si == 0:
                row["get_function_s"] = round(t_get, 4)
                row["first_call_s"] = round(t_get + times[0], 4)
                if not first_call_done:
                    row["process_first_call_s"] = round(t_load + t_get + times[0], 4)
                    rep["process_first_call_s"] = row["process_first_call_s"]
                    first_call_done = True
            rows.append(row)
    rep["rows"] = rows
    rep["worker_total_s"] = round(time.perf_counter() - T_START, 2)
    if not TIMING_ONLY:
        torch.save(outputs, prefix + ".pt")
    Path(prefix + ".json").write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
