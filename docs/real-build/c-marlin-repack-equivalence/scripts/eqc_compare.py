"""Device step 2 (repo root as cwd): for each repack object, fresh worker processes
(CUDA_CACHE_DISABLE=1) in modes fatbin / fatbin-hidden / cubin / ptx / link, then compare
outputs bitwise against `fatbin` (the rule's sm_90 SASS, as the driver picks it), and the
driver-JIT cubin (cuLink of the compute_80 PTX) section by section against the AOT sm_90 cubin.
Writes EQC/equivalence.json."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from elftools.elf.elffile import ELFFile  # noqa: E402

from jit_equivalence import hide_sass  # noqa: E402
from sm121_build.verify.fatbin import HostBinary  # noqa: E402

EQC = Path(os.environ.get("EQC", "/tmp/eqcrun"))
WORKER = Path(__file__).with_name("eqc_worker.py")
MODES = ["fatbin", "fatbin-hidden", "cubin", "ptx", "link"]


def sections(cubin: bytes) -> dict[str, bytes]:
    elf = ELFFile(io.BytesIO(cubin))
    return {s.name: (s.data() if s["sh_type"] != "SHT_NOBITS" else b"") for s in
            elf.iter_sections() if s.name}


def compare_cubins(aot: bytes, jit: bytes) -> dict:
    a, j = sections(aot), sections(jit)
    text = sorted(n for n in a if n.startswith(".text."))
    res = {"aot_bytes": len(aot), "jit_bytes": len(jit),
           "text_sections": {n[6:]: (a[n] == j.get(n)) for n in text},
           "sections_only_in_aot": sorted(set(a) - set(j)),
           "sections_only_in_jit": sorted(set(j) - set(a)),
           "sections_differing": sorted(n for n in set(a) & set(j) if a[n] != j[n]),
           "whole_file_equal": aot == jit}
    res["all_text_equal"] = bool(text) and all(res["text_sections"].values()) and \
        not any(n.startswith(".text.") for n in res["sections_only_in_jit"])
    ea, ej = ELFFile(io.BytesIO(aot)), ELFFile(io.BytesIO(jit))
    res["e_flags"] = [hex(ea.header["e_flags"]), hex(ej.header["e_flags"])]
    return res


def main() -> int:
    import torch

    runs = EQC / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_CACHE_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    report: dict = {"env": {"CUDA_CACHE_DISABLE": "1",
                            "CUDA_MODULE_LOADING(before torch)": os.environ.get(
                                "CUDA_MODULE_LOADING")},
                    "families": {}}
    for obj in sorted((EQC / "objs").glob("*_marlin_repack.cu.o")):
        fam = obj.name.split("_")[0]
        hidden = runs / f"{fam}-sass-hidden.o"
        n_hidden = hide_sass(obj, hidden, 90)
        fr: dict = {"object": obj.name, "hidden_sm90_entries": n_hidden, "modes": {}}
        with HostBinary.open(obj) as b:
            fr["entries"] = [f"{e.kind}:{e.sm}:{e.compression}:{e.size}" for e in b.entries]
            (aot_entry,) = [e for e in b.entries if e.kind == "elf" and e.arch == 90]
            aot = b.payload(aot_entry)
            fr["kernels_sm90_cubin"] = list(b.kernels(aot_entry))
            fr["kernels_ptx"] = [list(b.kernels(e)) for e in b.entries if e.kind == "ptx"]
        (runs / f"{fam}-aot-sm90.cubin").write_bytes(aot)
        with HostBinary.open(obj) as b:
            for e in b.entries:
                if e.kind == "ptx":
                    (runs / f"{fam}-compute_{e.arch}.ptx").write_bytes(b.payload(e))
        with HostBinary.open(hidden) as b:
            fr["entries_hidden_copy"] = [f"{e.kind}:{e.sm}" for e in b.entries]
        for mode in MODES:
            src = hidden if mode == "fatbin-hidden" else obj
            prefix = str(runs / f"{fam}-{mode}")
            t = time.monotonic()
            r = subprocess.run([sys.executable, str(WORKER), mode, str(src), fam, prefix],
                               env=env, capture_output=True, text=True)
            wall = round(time.monotonic() - t, 2)
            if r.returncode != 0:
                fr["modes"][mode] = {"error": r.stderr[-3000:], "process_wall_s": wall}
                print(f"{fam} {mode}: FAILED {r.stderr[-1500:]}", flush=True)
                continue
            info = json.loads(Path(prefix + ".json").read_text())
            info["process_wall_s"] = wall
            fr["modes"][mode] = info
            print(f"{fam} {mode}: wall {wall}s load {info.get('module_load_s')} "
                  f"jit_ms {info.get('jit_wall_ms')} first {info.get('process_first_call_s')}",
                  flush=True)
        ref_path = runs / f"{fam}-fatbin.pt"
        comps = []
        if ref_path.exists():
            ref = torch.load(ref_path)
            for mode in ("fatbin-hidden", "cubin", "ptx"):
                p = runs / f"{fam}-{mode}.pt"
                if not p.exists():
                    continue
                other = torch.load(p)
                for key, x in ref.items():
                    y = other[key]
                    d = (x.long() - y.long()).abs()
                    comps.append({"config": key, "vs": mode,
                                  "bitwise_equal": bool(torch.equal(x, y)),
                                  "max_abs_diff": int(d.max().item()),
                                  "differing_words": int((d != 0).sum().item()),
                                  "words": x.numel(), "nonzero_words": int((x != 0).sum())})
        fr["comparisons"] = comps
        fr["all_bitwise_equal"] = bool(comps) and all(c["bitwise_equal"] for c in comps)
        jit_path = runs / f"{fam}-link.cubin"
        if jit_path.exists():
            fr["cubin_aot_vs_driver_jit"] = compare_cubins(aot, jit_path.read_bytes())
        report["families"][fam] = fr
        print(f"{fam}: all_bitwise_equal={fr['all_bitwise_equal']} "
              f"text_equal={fr.get('cubin_aot_vs_driver_jit', {}).get('all_text_equal')}",
              flush=True)
    reps = int(os.environ.get("EQC_REPS", "0"))
    if reps:
        import statistics
        renv = {**env, "EQC_TIMING_ONLY": "1"}
        for fam, fr in report["families"].items():
            obj = EQC / "objs" / fr["object"]
            fr["repeats"] = {}
            for mode in ("fatbin", "fatbin-hidden", "ptx"):
                src = runs / f"{fam}-sass-hidden.o" if mode == "fatbin-hidden" else obj
                samples = []
                for i in range(reps):
                    prefix = str(runs / f"rep-{fam}-{mode}-{i}")
                    r = subprocess.run([sys.executable, str(WORKER), mode, str(src), fam, prefix],
                                       env=renv, capture_output=True, text=True)
                    if r.returncode == 0:
                        samples.append(json.loads(Path(prefix + ".json").read_text()))
                def stat(key):
                    v = [x[key] for x in samples if x.get(key) is not None]
                    return {"n": len(v), "median": statistics.median(v) if v else None,
                            "min": min(v, default=None), "max": max(v, default=None)}
                fr["repeats"][mode] = {k: stat(k) for k in
                                       ("module_load_s", "jit_wall_ms", "process_first_call_s")}
                fr["repeats"][mode]["per_kernel_first_call_s_median"] = {
                    row["kernel"]: statistics.median(
                        [x["rows"][j]["first_call_s"] for x in samples])
                    for j, row in enumerate(samples[0]["rows"])} if samples else {}
                print(f"{fam} {mode} x{len(samples)}: {fr['repeats'][mode]['process_first_call_s']}",
                      flush=True)
    (EQC / "equivalence-full.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(f["all_bitwise_equal"] for f in report["families"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
