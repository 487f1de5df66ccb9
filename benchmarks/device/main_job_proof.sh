#!/usr/bin/env bash
# The device proof of the main job's output for another GPU (issue #47), on the lent Hopper:
# the verified .so files `sm121-build --base IMAGE --gpu sm_90 --out DIR` wrote on the CPU
# machine (FA2 and `_C` of PyPI's vLLM 0.22.0 x86_64, whose torch 2.11 is the lent machine's)
# against the stock files of the same wheel.
#
#   KIT/stock/{_vllm_fa2_C,_C}.abi3.so.xz   the wheel's files
#   KIT/delta/{_vllm_fa2_C,_C}.abi3.so.delta the entries aot added (aot_delta.py make)
#   KIT/manifest.json                       the main job's manifest (the files' sha256)
#   bash benchmarks/device/main_job_proof.sh KIT OUTDIR   (PYTHONPATH: the package's deps)
#
# 1. each --out file is rebuilt from its stock file and its delta (aot_delta.py apply) and is
#    the one the manifest names (sha256): byte for byte what the main job wrote;
# 2. stock, JIT on (cache disabled): the driver JITs the PTX: outputs saved (the reference);
# 3. stock, CUDA_DISABLE_PTX_JIT=1: must fail ("PTX JIT compilation was disabled"): the
#    GPU cannot load it natively;
# 4. --out files, CUDA_DISABLE_PTX_JIT=1: must run, outputs compared bitwise with 2.
# FA2: varlen_fwd, 5 configs (dtype, head dim, causal); `_C`: the Marlin GPTQ/AWQ repack ops
# (18 cases), whose kernels are among `_C`'s JIT-only ones on sm_90.  Seeded inputs.
set -u
KIT=$1; OUT=$2
HERE=$(cd "$(dirname "$0")" && pwd)
W=/tmp/proof; rm -rf "$W"; mkdir -p "$W/stock" "$W/out" "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
for f in "$KIT/stock"/*.so.xz; do
  xz -dc "$f" > "$W/stock/$(basename "$f" .xz)"
done
for f in "$KIT/delta"/*.delta; do
  name=$(basename "$f" .delta)
  python3 "$HERE/aot_delta.py" apply "$W/stock/$name" "$f" "$W/out/$name" || exit 2
done
python3 - "$KIT/manifest.json" "$W/out" <<'EOF'
import hashlib, json, sys
from pathlib import Path
files = json.load(open(sys.argv[1]))["files"]
for name, row in files.items():
    local = Path(sys.argv[2]) / Path(name).name
    got = hashlib.sha256(local.read_bytes()).hexdigest()
    print(json.dumps({"file": name, "sha256_matches_manifest": got == row["sha256"]}))
    assert got == row["sha256"], name
EOF
status=0
for pair in "_vllm_fa2_C:fa2_outputs.py:fa2" "_C:marlin_outputs.py:marlin"; do
  IFS=: read -r so script tag <<< "$pair"
  stock="$W/stock/$so.abi3.so"; mine="$W/out/$so.abi3.so"
  echo "== $tag: stock, the driver's JIT (cache disabled)"
  CUDA_CACHE_DISABLE=1 python3 "$HERE/$script" "$stock" "$W/$tag-jit.pt" || status=1
  echo "== $tag: stock, CUDA_DISABLE_PTX_JIT=1 (must fail)"
  CUDA_DISABLE_PTX_JIT=1 CUDA_CACHE_DISABLE=1 python3 "$HERE/$script" "$stock" "$W/$tag-x.pt" \
    > "$W/$tag-x.log" 2>&1
  rc=$?; cat "$W/$tag-x.log"; echo "{\"stock_without_jit_exit\": $rc}"
  # it fails where the kernel runs, or (CUDA errors are asynchronous) at the next CUDA call
  if [ "$rc" -eq 0 ] || ! grep -q "PTX JIT compilation was disabled" "$W/$tag-x.log"; then
    status=1
  fi
  echo "== $tag: the main job's file, CUDA_DISABLE_PTX_JIT=1"
  CUDA_DISABLE_PTX_JIT=1 CUDA_CACHE_DISABLE=1 python3 "$HERE/$script" "$mine" "$W/$tag-aot.pt" || status=1
  echo "== $tag: bitwise"
  python3 "$HERE/fa2_compare.py" "$W/$tag-jit.pt" "$W/$tag-aot.pt" || status=1
done
echo "{\"proof_status\": $status}"
exit $status
