#!/usr/bin/env bash
# The device proof of `sm121-build prove` (issue #57), on a lent Hopper (H100/H200: sm_90),
# no Docker, no network; nvcc 13.0 and PyTorch 2.11+cu130 installed system-wide, whose torch
# vLLM 0.22.0's x86_64 wheel was built against.
#
#   KIT/stock/{_vllm_fa2_C,_C}.abi3.so.xz   the wheel's files (vllm/vllm_flash_attn/_vllm_fa2_C,
#                                           vllm/_C), xz'd
#   KIT/aot/{...}.abi3.so.xz                their aot'd copies, made on the CPU machine with
#                                           `sm121-build aot FILE --gpu sm_90 --out DIR`; or,
#   KIT/delta/{...}.abi3.so.delta           where the carry is short of room, the entries aot
#                                           added (benchmarks/device/aot_delta.py make)
#   bash prove_run.sh KIT OUTDIR [STEP]     from the repository root (python3 must import the
#                                           package's dependencies: click, PyYAML, lz4,
#                                           zstandard; PYTHONPATH=. for the package itself)
#
# 1. `prove` on the aot'd files against the stock ones: must exit 0, verdict "proven" or
#    "partial" (nothing differs; the cases did not launch every added kernel: its coverage
#    is printed) (OUTDIR/proof.json);
# 2. a broken copy: in one added cubin of `_C.abi3.so`, one bit of one instruction flipped
#    in every Marlin repack kernel (the register it writes), the entry recompressed into its
#    own slot, so the file still loads; `prove` must exit 3 and name `_C.abi3.so` and the
#    ops whose output changed (or the cubin, if the driver refuses it)
#    (OUTDIR/broken-proof.json).
# STEP: `all` (the default), `proof` (1. alone) or `broken` (2. alone, on `_C.abi3.so` only:
# FA2's stock JIT alone takes ~6 min on an H100, so the two fit one 10-minute call each).
set -u
KIT=$1; OUT=$2; STEP=${3:-all}
HERE=$(pwd)
W=${TMPDIR:-/tmp}/prove-device; rm -rf "$W"; mkdir -p "$W/stock" "$W/aot" "$OUT"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
for f in "$KIT/stock"/*.so.xz; do
  xz -dc "$f" > "$W/stock/$(basename "$f" .xz)" || exit 2
done
if [ -d "$KIT/aot" ]; then
  for f in "$KIT/aot"/*.so.xz; do xz -dc "$f" > "$W/aot/$(basename "$f" .xz)" || exit 2; done
else
  for f in "$KIT/delta"/*.delta; do
    name=$(basename "$f" .delta)
    python3 benchmarks/device/aot_delta.py apply "$W/stock/$name" "$f" "$W/aot/$name" || exit 2
  done
fi
status=0

if [ "$STEP" != broken ]; then
echo "== 1. prove: the aot'd files against the stock ones (must be proven, or partial)"
python3 -m sm121_build prove --files "$W/aot" --stock "$W/stock" --json "$OUT/proof.json"
rc=$?
echo "{\"prove_exit\": $rc}"
python3 - "$OUT/proof.json" <<'EOF' || status=1
import json, sys
proof = json.load(open(sys.argv[1]))
from sm121_build.core.shipped import schema
try:
    import jsonschema
except ImportError:  # not installed there: the schema check is skipped (said)
    print("jsonschema not installed: proof.json not checked against its schema")
else:
    jsonschema.Draft202012Validator(schema("proof")).validate(proof)
print(json.dumps({"verdict": proof["verdict"], "gpu": proof["gpu"],
                  "cubins": sum(len(f["cubins"]) for f in proof["files"]),
                  "ops": len(proof["ops"]),
                  "bitwise_equal": sum(bool(o["bitwise_equal"]) for o in proof["ops"]),
                  "coverage": proof["coverage"],
                  "launched": {f["name"]: f["coverage"]["launched"] for f in proof["files"]}}))
assert proof["verdict"] in ("proven", "partial"), proof["problems"]
EOF
[ "$rc" -eq 0 ] || status=1
fi

if [ "$STEP" != proof ]; then
echo "== 2. a broken copy: one instruction changed in one added cubin of _C.abi3.so"
mkdir -p "$W/broken"
cp "$W/aot/_C.abi3.so" "$W/broken/"
python3 - "$W/stock/_C.abi3.so" "$W/broken/_C.abi3.so" <<'EOF' || exit 2
"""Flip bit 16 (the low bit of the destination register) of one instruction in the middle
of every Marlin repack kernel of the first added cubin that has one; recompress the entry
(zstd) into its own slot, its header's compressed size updated, the rest of the slot zero."""
import json, mmap, struct, sys
import zstandard
from sm121_build.cuda.added import added_entries
from sm121_build.cuda.elf import Elf
from sm121_build.cuda.fatbin import STO_CUDA_ENTRY, HostBinary

SKIP = {0x918, 0x947, 0x94D}  # NOP, BRA, EXIT: a changed register there changes nothing
stock, target = sys.argv[1], sys.argv[2]
with HostBinary.open(stock) as before, HostBinary.open(target) as after:
    chosen = None
    for entry in added_entries(before, after):
        cubin = bytearray(after.payload(entry))
        elf = Elf.read(bytes(cubin))
        kernels = [k for k in elf.functions(elf.section(".symtab"), STO_CUDA_ENTRY)
                   if "marlin_repack" in k]
        if kernels:
            chosen = (entry, cubin, elf, kernels)
            break
assert chosen, "no added cubin of _C.abi3.so holds a Marlin repack kernel"
entry, cubin, elf, kernels = chosen
changed = []
for kernel in kernels:
    text = elf.section(".text." + kernel)
    count = text.size // 16
    for i in range(count // 2, count):
        at = text.offset + 16 * i
        if struct.unpack_from("<H", cubin, at)[0] & 0xFFF not in SKIP:
            cubin[at + 2] ^= 0x01
            changed.append({"kernel": kernel, "instruction": i})
            break
assert entry.compression == "zstd", entry
packed = zstandard.ZstdCompressor(level=19).compress(bytes(cubin))
with open(target, "r+b") as handle, mmap.mmap(handle.fileno(), 0) as data:
    header = next(entry.offset - size for size in range(64, 4097, 8)
                  if struct.unpack_from("<HHI", data, entry.offset - size)[::2] == (2, size))
    slot = struct.unpack_from("<Q", data, header + 8)[0]
    assert len(packed) <= slot, f"recompressed {len(packed)} bytes, the slot has {slot}"
    data[entry.offset:entry.offset + slot] = packed + bytes(slot - len(packed))
    struct.pack_into("<I", data, header + 16, len(packed))
print(json.dumps({"broken_entry": entry.index, "sm": entry.sm, "changed": changed[:3],
                  "kernels_changed": len(changed)}))
EOF
python3 -m sm121_build prove --files "$W/broken" --stock "$W/stock" \
  --json "$OUT/broken-proof.json" 2> "$W/broken.err"
rc=$?
cat "$W/broken.err"
echo "{\"broken_prove_exit\": $rc}"
# caught: exit 3 (not proven), and the one error line names the file
if [ "$rc" -ne 3 ] || ! grep -q "^error: not proven: .*_C.abi3.so" "$W/broken.err"; then
  status=1
fi
python3 -c "import json,sys; p=json.load(open(sys.argv[1])); print(json.dumps(p['problems'][:5], indent=1))" \
  "$OUT/broken-proof.json"
fi
echo "{\"device_run_status\": $status}"
exit $status
