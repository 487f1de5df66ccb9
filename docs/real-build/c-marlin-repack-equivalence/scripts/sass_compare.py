"""Local: per-kernel instruction comparison of nvdisasm output, AOT sm_90 cubin vs driver-JIT cubin,
and a check that toolkit ptxas on the object's own PTX reproduces the AOT cubin byte for byte."""
import difflib, importlib.util, json, re, subprocess, sys
from pathlib import Path
A = Path("/tmp/eqc/artifacts")
spec = importlib.util.spec_from_file_location("cmp", "/tmp/eqc/scripts/eqc_compare.py")
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
cmp = importlib.util.module_from_spec(spec); spec.loader.exec_module(cmp)

def parse(path):
    funcs, cur = {}, None
    for line in open(path):
        m = re.match(r'\s*\.section\s+\.text\.(\S+?),', line)
        if m: cur = m.group(1); funcs.setdefault(cur, []); continue
        if line.strip().startswith('.section'): cur = None
        if cur:
            m = re.match(r'\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;', line)
            if m: funcs[cur].append(re.sub(r'\s+', ' ', m.group(1)))
    return funcs

res = {}
for f in ("gptq", "awq"):
    a, j = parse(A / f"{f}-aot-sm90.sass"), parse(A / f"{f}-driver-jit.sass")
    res[f] = {"kernels": {k: {"instructions_aot_jit": [len(a[k]), len(j[k])],
                              "identical_instruction_line_ratio": round(difflib.SequenceMatcher(
                                  None, a[k], j[k], autojunk=False).ratio(), 3)} for k in sorted(a)}}
    ptx = A / f"{f}-compute_80.ptx"
    clean = Path(f"/tmp/eqc/local/{f}-dev.ptx"); clean.write_bytes(ptx.read_bytes().replace(b"\0", b""))
    aot = (A / f"{f}-aot-sm90.cubin").read_bytes(); jit = (A / f"{f}-link.cubin").read_bytes()
    for arch in ("sm_90", "sm_90a"):
        o = Path(f"/tmp/eqc/local/{f}-ptxas-{arch}.cubin")
        subprocess.run(["ptxas", "-arch", arch, "-m64", str(clean), "-o", str(o)], check=True)
        c = o.read_bytes()
        res[f][f"toolkit_ptxas_13.0.88_{arch}"] = {
            "byte_identical_to_aot": c == aot,
            "text_equal_to_aot": cmp.compare_cubins(aot, c)["all_text_equal"],
            "text_equal_to_driver_jit": cmp.compare_cubins(c, jit)["all_text_equal"]}
(Path("/tmp/eqc/sass_compare.json")).write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res, indent=1))
