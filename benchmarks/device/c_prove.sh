#!/usr/bin/env bash
# Issue #63 on a lent Hopper (sm_90; no Docker, no network; python3 with torch 2.11+cu130):
# `sm121-build prove` on vLLM 0.22.0's `_C` aot'd for sm_90, its Marlin GEMM cases derived
# from the added kernels, once per aot'd variant (the honest one, one with a planted defect).
# The aot runs on the CPU machine (`sm121-build aot _C.abi3.so --gpu sm_90`, with
# `--cuda-home` for a planted ptxas); each variant travels as the fatbin entries aot added
# (aot_delta.py make), since the stock file alone fills the 64 MiB a call carries.
#
#   KEEP/C.xz.1                  the first bytes of the stock file xz'd (vLLM 0.22.0 x86_64
#                                wheel's vllm/_C.abi3.so), left by a call before this one
#   KIT/C.xz.2                   the rest of those bytes
#   KIT/C.sha256                 the stock file's sha256
#   KIT/delta/VARIANT.delta      each aot'd variant (honest first: its name sorts first)
#   KIT/wheels/*.whl             lz4, zstandard, isal, packaging for that python3
#   bash c_prove.sh KIT KEEP OUT from the repository root
#
# OUT gets, per variant, VARIANT.prove.log (stdout and stderr), VARIANT.proof.json and a
# line of times.jsonl.
set -u
KIT=$1; KEEP=$2; OUT=$3
HERE=$(pwd)
W=${TMPDIR:-/tmp}/c-prove; rm -rf "$W"; mkdir -p "$W/stock" "$W/deps" "$OUT"
python3 -m pip install -q --no-deps --target "$W/deps" "$KIT"/wheels/*.whl || exit 2
export PYTHONPATH="$HERE:$W/deps${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
cat "$KEEP/C.xz.1" "$KIT/C.xz.2" | xz -dc > "$W/stock/_C.abi3.so" || exit 2
(cd "$W/stock" && echo "$(cat "$KIT/C.sha256")  _C.abi3.so" | sha256sum -c -) || exit 2
for delta in "$KIT"/delta/*.delta; do
  variant=$(basename "$delta" .delta)
  mkdir -p "$W/$variant"
  python3 benchmarks/device/aot_delta.py apply "$W/stock/_C.abi3.so" "$delta" \
    "$W/$variant/_C.abi3.so" || exit 2
  start=$(date +%s)
  python3 -m sm121_build --progress plain prove --files "$W/$variant" --stock "$W/stock" \
    --python python3 --json "$OUT/$variant.proof.json" --timeout "${PROVE_CHILD_S:-300}" \
    > "$OUT/$variant.prove.log" 2>&1
  code=$?
  echo "== $variant: exit $code"
  tail -4 "$OUT/$variant.prove.log"
  echo "{\"variant\": \"$variant\", \"prove_s\": $(( $(date +%s) - start )), \"prove_exit\": $code, \"cores\": $(nproc)}" \
    | tee -a "$OUT/times.jsonl"
done
