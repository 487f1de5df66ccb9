#!/usr/bin/env bash
# Issue #63 on a lent Hopper (sm_90; no Docker, no network; python3 with torch 2.11+cu130):
# `sm121-build prove` on vLLM 0.22.0's `_C`, `_moe_C` and FA2 aot'd for sm_90, their cases
# derived from the added kernels (Marlin GEMM and MoE, FA2's attention), once per aot'd
# variant (honest ones, and ones with a planted defect).  The aot runs on the CPU machine (`sm121-build aot FILE --gpu sm_90`,
# with `--cuda-home` for a planted ptxas); each variant travels as the fatbin entries aot
# added (aot_delta.py make).  A call carries 64 MiB with the working tree, so the stock `_C`
# comes in two calls, the first leaving its part in KEEP:
#
#   KEEP/C.xz.1                the first bytes of the stock `_C.abi3.so` xz'd (vLLM 0.22.0
#                              x86_64 wheel's vllm/_C.abi3.so); KIT/C.xz.2 the rest
#   KIT/_moe_C.xz              the stock `_moe_C.abi3.so`, xz'd
#   KEEP/_vllm_fa2_C.xz (or KIT's)  the stock FA2 `_vllm_fa2_C.abi3.so`, xz'd (53 MB: it
#                              comes in a call of its own, its deltas in the next ones)
#   KIT/sums.txt               the stock files' sha256 (`sha256sum` lines)
#   KIT/wheels/*.whl (or KEEP's)  lz4, zstandard, isal, packaging for that python3
#   KIT/delta/FILE.VARIANT.delta (or KEEP's)  an aot'd variant of FILE (`_C`, `_moe_C`,
#                              `_vllm_fa2_C`),
#                              run in the order of VARIANT (`1-honest`, `2-planted`, ...)
#   bash c_prove.sh KIT KEEP OUT   from the repository root (KEEP may be KIT)
#
# OUT gets, per variant, FILE.VARIANT.prove.log (stdout and stderr), FILE.VARIANT.proof.json
# and a line of times.jsonl.
set -u
KIT=$(cd "$1" && pwd); KEEP=$(cd "$2" && pwd); OUT=$3
HERE=$(pwd)
W=${TMPDIR:-/tmp}/c-prove; rm -rf "$W"; mkdir -p "$W/stock" "$W/deps" "$OUT"
wheels=$(ls "$KIT"/wheels/*.whl "$KEEP"/wheels/*.whl 2>/dev/null | sort -u)
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --target "$W/deps" $wheels || exit 2
export PYTHONPATH="$HERE:$W/deps${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
if [ -f "$KIT/C.xz.2" ]; then
  cat "$KEEP/C.xz.1" "$KIT/C.xz.2" | xz -dc > "$W/stock/_C.abi3.so" || exit 2
fi
if [ -f "$KIT/_moe_C.xz" ]; then xz -dc "$KIT/_moe_C.xz" > "$W/stock/_moe_C.abi3.so" || exit 2; fi
for kept in "$KEEP" "$KIT"; do  # FA2's stock file (vllm/vllm_flash_attn/), staged before
  if [ -f "$kept/_vllm_fa2_C.xz" ]; then
    xz -dc "$kept/_vllm_fa2_C.xz" > "$W/stock/_vllm_fa2_C.abi3.so" || exit 2; break
  fi
done
(cd "$W/stock" && sha256sum -c --ignore-missing "$KIT/sums.txt") || exit 2
for delta in $(for d in "$KEEP"/delta/*.delta "$KIT"/delta/*.delta; do
                 [ -f "$d" ] || continue; b=$(basename "$d"); echo "${b#*.} $d"
               done | sort -u | cut -d' ' -f2); do
  base=$(basename "$delta" .delta); file=${base%%.*}; variant=$file.${base#*.}
  [ -f "$W/stock/$file.abi3.so" ] || continue
  mkdir -p "$W/$variant"
  python3 benchmarks/device/aot_delta.py apply "$W/stock/$file.abi3.so" "$delta" \
    "$W/$variant/$file.abi3.so" || exit 2
  start=$(date +%s)
  python3 -m sm121_build --progress plain prove --files "$W/$variant" --stock "$W/stock" \
    --python python3 --json "$OUT/$variant.proof.json" --timeout "${PROVE_CHILD_S:-240}" \
    > "$OUT/$variant.prove.log" 2>&1
  code=$?
  echo "== $variant: exit $code"
  grep -E "case\(s\) derived|verdict|^error" "$OUT/$variant.prove.log" | head -5
  echo "{\"variant\": \"$variant\", \"prove_s\": $(( $(date +%s) - start )), \"prove_exit\": $code, \"cores\": $(nproc)}" \
    | tee -a "$OUT/times.jsonl"
done
