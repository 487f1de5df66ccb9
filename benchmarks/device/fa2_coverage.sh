#!/usr/bin/env bash
# Issue #63 on a lent Hopper (sm_90; no Docker, no network; python3 with torch 2.11+cu130):
# how many of the FA2 kernels aot adds do prove's cases launch, measured by the recorder
# (harness_run.Recorder: torch's profiler around each case's first call), with the 8 fixed
# cases alone and with the cases fa2_kernels.py derives from the kernels' names.
#
#   KIT/fa2/_vllm_fa2_C.abi3.so.xz   vLLM 0.22.0 x86_64 wheel's vllm/vllm_flash_attn/ file
#   KIT/wheels/*.whl                  lz4, zstandard, isal, packaging for that python3
#   bash fa2_coverage.sh KIT OUT      from the repository root; OUT gets the children's lines
#
# 1. aot the stock file for sm_90 on every core (the tool's own command);
# 2. the native file, the JIT off: harness_fa2.py with the fixed cases, then with
#    `--kernels` (every added kernel's name), each run's added kernels given to its
#    recorder; the launches counted against the 1,472 added and the model's prediction;
# 3. a sample of the derived cases on the stock file through the driver's JIT (as long as
#    STOCK_S allows) and on the native file, outputs compared bit for bit (every output).
set -u
KIT=$1; OUT=$2; STOCK_S=${STOCK_S:-120}
HERE=$(pwd)
W=${TMPDIR:-/tmp}/fa2-coverage; rm -rf "$W"; mkdir -p "$W/stock" "$W/aot" "$W/deps" "$OUT"
python3 -m pip install -q --no-deps --target "$W/deps" "$KIT"/wheels/*.whl || exit 2
export PYTHONPATH="$HERE:$W/deps${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
xz -dc "$KIT/fa2/_vllm_fa2_C.abi3.so.xz" > "$W/stock/_vllm_fa2_C.abi3.so" || exit 2
echo "== 1. aot for sm_90, $(nproc) cores"
start=$(date +%s)
python3 -m sm121_build --progress plain aot "$W/stock/_vllm_fa2_C.abi3.so" --gpu sm_90 \
  --out "$W/aot" --no-cache > "$OUT/aot.log" 2>&1 || { tail -5 "$OUT/aot.log"; exit 2; }
tail -3 "$OUT/aot.log"
echo "aot: $(( $(date +%s) - start )) s"
gzip -dc tests/data/kernel_names/vllm-0.22.0-x86_64-fa2-sm90-added.txt.gz > "$W/names.txt"
python3 -c "import json,sys; json.dump(open(sys.argv[1]).read().split(), open(sys.argv[2],'w'))" \
  "$W/names.txt" "$W/kernels.json"
HARNESS=sm121_build/jobs/payload/harness_fa2.py
native() {  # native() TAG ARGS...: the aot'd file, the JIT off, its launches recorded
  local tag=$1; shift
  local s; s=$(date +%s)
  CUDA_DISABLE_PTX_JIT=1 CUDA_CACHE_DISABLE=1 timeout 200 python3 "$HARNESS" \
    "$W/aot/_vllm_fa2_C.abi3.so" "$W/$tag.pt" "$W/kernels.json" "$@" \
    > "$OUT/$tag.jsonl" 2> "$OUT/$tag.err"
  echo "{\"run\": \"$tag\", \"exit\": $?, \"seconds\": $(( $(date +%s) - s ))}"
}
echo "== 2. coverage: the fixed cases, then the derived ones (native, JIT off)"
native fixed
native derived --kernels "$W/names.txt"
python3 - "$OUT" "$W/names.txt" <<'EOF'
import json, sys
from pathlib import Path
from sm121_build.jobs.payload import fa2_kernels, harness_fa2
out, names = Path(sys.argv[1]), Path(sys.argv[2]).read_text().split()
import torch
p = torch.cuda.get_device_properties(0)
gpu = fa2_kernels.Gpu(p.major, p.minor, p.shared_memory_per_block_optin,
                      p.shared_memory_per_multiprocessor, p.multi_processor_count)
derived = fa2_kernels.derive(names, gpu, first=fa2_kernels.fixed_cases())
predicted = {n for expected in derived.expects.values() for n in expected}
print(json.dumps({"model": {"cases": len(derived.cases), "predicted": len(predicted),
                            "unreachable": len(derived.unreachable)}}))
for tag in ("fixed", "derived"):
    lines = [json.loads(l) for l in (out / f"{tag}.jsonl").read_text().splitlines()
             if l.startswith("{")]
    launched = {l["launched"] for l in lines if "launched" in l}
    cases = [l for l in lines if "first_s" in l]
    errors = [l for l in lines if "error" in l]
    recorder = [l["recorder"] for l in lines if "recorder" in l]
    print(json.dumps({"run": tag, "cases_ran": len(cases), "case_errors": len(errors),
                      "first_error": errors[0] if errors else None, "recorder": recorder,
                      "launched": len(launched), "of_added": len(names),
                      "predicted": len(predicted),
                      "predicted_not_launched": len(predicted - launched),
                      "launched_not_predicted": len(launched - predicted)}))
    (out / f"{tag}.launched.txt").write_text("\n".join(sorted(launched)) + "\n")
EOF
echo "== 3. a sample of derived cases, stock JIT vs native, every output (${STOCK_S} s for the stock side)"
CUDA_CACHE_DISABLE=1 timeout "$STOCK_S" python3 "$HARNESS" "$W/stock/_vllm_fa2_C.abi3.so" \
  "$W/sample.jit.pt" --kernels "$W/names.txt" --slice 0/60 > "$OUT/sample.jit.jsonl" 2>&1
echo "{\"stock_sample_exit\": $?}"
CUDA_DISABLE_PTX_JIT=1 CUDA_CACHE_DISABLE=1 timeout 60 python3 "$HARNESS" \
  "$W/aot/_vllm_fa2_C.abi3.so" "$W/sample.native.pt" --kernels "$W/names.txt" --slice 0/60 \
  > "$OUT/sample.native.jsonl" 2>&1
echo "{\"native_sample_exit\": $?}"
if [ -f "$W/sample.jit.pt" ] && [ -f "$W/sample.native.pt" ]; then
  python3 sm121_build/jobs/payload/compare_outputs.py "$W/sample.jit.pt" "$W/sample.native.pt" \
    > "$OUT/sample.compare.jsonl" 2>&1
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
eq=[r for r in rows if r.get('bitwise_equal')]
print(json.dumps({'compared': len(rows), 'bitwise_equal': len(eq),
                  'outputs': sum(r.get('outputs') or 0 for r in rows)}))" "$OUT/sample.compare.jsonl"
else
  echo "stock sample did not finish within ${STOCK_S} s: nothing compared"
  grep -c first_s "$OUT/sample.jit.jsonl"
fi
