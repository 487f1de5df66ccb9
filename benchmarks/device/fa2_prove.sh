#!/usr/bin/env bash
# Issue #63 on a lent Hopper (sm_90; no Docker, no network; python3 with torch 2.11+cu130):
# `sm121-build prove` itself on vLLM 0.22.0's FA2 aot'd for sm_90: the cases derived from
# the added kernels, the stock side in --jobs processes.
#
#   KIT/fa2/_vllm_fa2_C.abi3.so.xz   vLLM 0.22.0 x86_64 wheel's vllm/vllm_flash_attn/ file
#   KIT/wheels/*.whl                  lz4, zstandard, isal, packaging for that python3
#   bash fa2_prove.sh KIT OUT [HEAD_DIM]   from the repository root
#
# HEAD_DIM (a planted defect; one of FA2's head dims: 32, 64, 96, 128, 192, 256, or `all`
# for every module): aot runs with the CUDA home of fa2_plant_ptxas.sh, whose ptxas rounds
# every f32 fma toward zero in the modules that hold that head dim's kernels only (every FA2
# module for `all`); the rest are compiled as they are.  prove must then
# say "not proven" (exit 3), naming the cases of those modules.
# OUT gets aot.log, prove.log (its stdout and stderr), proof.json and times.json.
set -u
KIT=$1; OUT=$2; PLANT=${3:-}
HERE=$(pwd)
W=${TMPDIR:-/tmp}/fa2-prove; rm -rf "$W"; mkdir -p "$W/stock" "$W/aot" "$W/deps" "$OUT"
python3 -m pip install -q --no-deps --target "$W/deps" "$KIT"/wheels/*.whl || exit 2
export PYTHONPATH="$HERE:$W/deps${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
xz -dc "$KIT/fa2/_vllm_fa2_C.abi3.so.xz" > "$W/stock/_vllm_fa2_C.abi3.so" || exit 2
home=()
if [ -n "$PLANT" ]; then
  real=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
  cuda=$(dirname "$(dirname "$(readlink -f "$real")")")
  bash "$HERE/benchmarks/device/fa2_plant_ptxas.sh" "$cuda" "$W/cuda" "$PLANT" || exit 2
  home=(--cuda-home "$W/cuda")
fi
start=$(date +%s)
python3 -m sm121_build --progress plain aot "$W/stock/_vllm_fa2_C.abi3.so" --gpu sm_90 \
  --out "$W/aot" --no-cache "${home[@]}" > "$OUT/aot.log" 2>&1 || { tail -5 "$OUT/aot.log"; exit 2; }
aot_s=$(( $(date +%s) - start ))
tail -2 "$OUT/aot.log"
[ -n "$PLANT" ] && echo "planted modules: $(sort -u "$W/cuda/planted.txt" | wc -l)"
start=$(date +%s)
python3 -m sm121_build --progress plain prove --files "$W/aot" --stock "$W/stock" \
  --python python3 --json "$OUT/proof.json" --timeout "${PROVE_CHILD_S:-400}" \
  > "$OUT/prove.log" 2>&1
code=$?
prove_s=$(( $(date +%s) - start ))
tail -6 "$OUT/prove.log"
echo "{\"aot_s\": $aot_s, \"prove_s\": $prove_s, \"prove_exit\": $code, \"cores\": $(nproc)}" \
  | tee "$OUT/times.json"
