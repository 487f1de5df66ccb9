"""Local: /tmp/eqc/dev{1,2}/equivalence-full.json + build.json -> /tmp/eqc/equivalence.json."""
import json
from pathlib import Path

E = Path("/tmp/eqc")
runs = {n: json.loads((E / n / "equivalence-full.json").read_text()) for n in ("dev1", "dev2")}
build = json.loads((E / "dev2" / "build.json").read_text())
main = runs["dev2"]
out = {
    "what": "vLLM 0.33.0 _C Marlin repack kernels (gptq_marlin_repack.cu, awq_marlin_repack.cu; "
            "guard 7.5;8.0+PTX -> 8.0+PTX under TORCH_CUDA_ARCH_LIST=12.1). Rule rendered for "
            "sm_90 adds -gencode arch=compute_80,code=sm_90. 'sass' = the object's fatbin as is "
            "(driver picks the rule's sm_90 cubin); 'jit' = the same fatbin with the sm_90 cubin "
            "entry's arch field set to sm_100 (driver JIT-compiles the compute_80 PTX, as for "
            "the stock file). Fresh process per mode, CUDA_CACHE_DISABLE=1. Primary run: dev2; "
            "dev1 (an identical earlier run) agrees.",
    "device": "NVIDIA H100 80GB HBM3 (sm_90), lent nvidia-h100-x1",
    "driver": build["tools"]["driver"].split(", ")[1] + " (cuDriverGetVersion "
              f"{main['families']['gptq']['modes']['fatbin']['cuDriverGetVersion']})",
    "driver_jit_compiler": "ptxas in driver: 'Cuda compilation tools, release 13.0, V13.0.98', "
                           "target sm_90a (from the JIT cubin's .note.nv.tkinfo and JIT info log)",
    "nvcc": build["tools"]["nvcc"].replace("\n", " | "),
    "torch": build["torch"],
    "TORCH_CUDA_ARCH_LIST": {"image_default": build["tools"]["image_TORCH_CUDA_ARCH_LIST"],
                             "used": build["env_TORCH_CUDA_ARCH_LIST"]},
    "configure": {"seconds": build["configure"]["seconds"], "lines": build["configure_lines"][:2]
                  + [l for l in build["configure_lines"] if "Marlin kernels" in l]},
    "patch": build["patch"],
    "objects": {f: {"object": o["object"], "gencode": o["gencode"],
                    "compile_s_ninja_log": o["compile_s"], "bytes": o["bytes"],
                    "fatbin_entries": main["families"][f]["entries"]}
                for f, o in build["objects"].items()},
    "compile_wall_s_both_objects_ninja_j2": build["compile"]["wall_s"],
    "configs": [], "first_call": {}, "cubin_aot_vs_driver_jit": {},
}
for fam, fr in main["families"].items():
    rows = {r["config"]: r for r in fr["modes"]["fatbin"]["rows"]}
    jrows = {r["config"]: r for r in fr["modes"]["fatbin-hidden"]["rows"]}
    by = {}
    for c in fr["comparisons"]:
        by.setdefault(c["config"], {})[c["vs"]] = c
    run1 = {c["config"] + c["vs"]: c["bitwise_equal"]
            for c in runs["dev1"]["families"][fam]["comparisons"]}
    for key, comps in by.items():
        _, b, a8, shape = key.split(":")
        k, n = shape.split("x")
        row = {"family": fam, "num_bits": int(b[1:]), "is_a_8bit": a8 == "a8=1",
               "size_k": int(k), "size_n": int(n), "kernel": rows[key]["kernel"],
               "words": comps["fatbin-hidden"]["words"],
               "bitwise_equal_sass_vs": {m: c["bitwise_equal"] for m, c in comps.items()},
               "max_abs_diff": max(c["max_abs_diff"] for c in comps.values()),
               "differing_words": max(c["differing_words"] for c in comps.values()),
               "every_output_word_written": all(r["covered"]
                                                for m in ("fatbin", "fatbin-hidden", "cubin", "ptx")
                                                for r in fr["modes"][m]["rows"]
                                                if r["config"] == key),
               "num_regs_sass_jit": [rows[key]["num_regs"], jrows[key]["num_regs"]],
               "launch_ms_sass_jit": [rows[key]["launch2_ms"], jrows[key]["launch2_ms"]],
               "run1_bitwise_equal": all(run1.get(key + m) for m in comps)}
        if "first_call_s" in rows[key]:
            row["kernel_first_call_s_sass_jit"] = [rows[key]["first_call_s"],
                                                   jrows[key]["first_call_s"]]
        out["configs"].append(row)
    out["first_call"][fam] = {
        "note": "process first call = cuModuleLoadDataEx + cuModuleGetFunction + first launch "
                "+ sync; the JIT happens inside the module load (jit_wall_ms = CU_JIT_WALL_TIME)",
        "runs": {n: {m: {k: runs[n]["families"][fam]["modes"][m].get(k)
                         for k in ("module_load_s", "jit_wall_ms", "process_first_call_s")}
                     for m in ("fatbin", "fatbin-hidden", "cubin", "ptx")} for n in runs},
        "repeats_x5": {m: {k: v for k, v in d.items() if k != "per_kernel_first_call_s_median"}
                       for m, d in fr["repeats"].items()},
        "cuLink_jit_ms": [runs[n]["families"][fam]["modes"]["link"]["jit_wall_ms"] for n in runs],
    }
    cb = fr["cubin_aot_vs_driver_jit"]
    out["cubin_aot_vs_driver_jit"][fam] = {
        "aot_sm90_cubin_bytes": cb["aot_bytes"], "driver_jit_cubin_bytes": cb["jit_bytes"],
        "text_sections_equal": cb["text_sections"], "sections_differing": cb["sections_differing"],
        "sections_only_in_aot": cb["sections_only_in_aot"],
        "sections_only_in_jit": cb["sections_only_in_jit"]}
out["all_configs_bitwise_equal"] = all(all(r["bitwise_equal_sass_vs"].values())
                                       and r["run1_bitwise_equal"] for r in out["configs"])
(E / "equivalence.json").write_text(json.dumps(out, indent=1) + "\n")
print(len(out["configs"]), out["all_configs_bitwise_equal"])
