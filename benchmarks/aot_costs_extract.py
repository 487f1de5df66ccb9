"""The PTX modules aot would compile in vLLM wheels, as text files and a manifest: what
`benchmarks/aot_schedule.py` runs on a machine the .so files cannot travel to (the PTX of
vLLM 0.33.0's `_C`, `_moe_C` and FA2 for both platforms, 1.4 GB, is ~25 MB as `tar cJf`).

Run: python benchmarks/aot_costs_extract.py OUT_DIR [--target sm_121] WHEEL...

Writes OUT_DIR/ptx/<sha256>.ptx (each distinct PTX once) and OUT_DIR/manifest.json: per
module its wheel platform, file, container, ptxas arch and options, the digests of the PTX
text and of the entry as the file stores it (the keys of `data/ptxas_costs.json`), sizes and
kernel count.  The modules are chosen by aot's own rule (`jit_ptx`: no cubin the GPU loads,
PTX it can JIT).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm121_build.cuda.binary import jit_ptx  # noqa: E402
from sm121_build.cuda.compat import parse_target  # noqa: E402
from sm121_build.cuda.fatbin import entry_payload  # noqa: E402
from sm121_build.cuda.fatbin_rewrite import entry_options, read_layout  # noqa: E402
from sm121_build.cuda.ptxas import arch_for, checked_options  # noqa: E402

MEMBERS = ("vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
           "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")
ENTRY = re.compile(rb"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s", re.M)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("wheels", nargs="+", type=Path)
    parser.add_argument("--target", default="sm_121")
    args = parser.parse_args()
    target = parse_target(args.target)
    (args.out / "ptx").mkdir(parents=True, exist_ok=True)
    rows = []
    for wheel in args.wheels:
        platform = "aarch64" if "aarch64" in wheel.name else "x86_64"
        with zipfile.ZipFile(wheel) as archive:
            for member in MEMBERS:
                data = archive.read(member)
                layout = read_layout(data, member)
                for index, container in enumerate(layout.containers):
                    entry = jit_ptx(container.described, target)
                    if entry is None:
                        continue
                    raw = container.entries[container.described.index(entry)]
                    ptx = entry_payload(data, entry, member).rstrip(b"\0")
                    digest = hashlib.sha256(ptx).hexdigest()
                    path = args.out / "ptx" / f"{digest}.ptx"
                    if not path.exists():
                        path.write_bytes(ptx)
                    rows.append({
                        "platform": platform, "file": member, "container": index,
                        "arch": arch_for(target, entry.variant),
                        "options": checked_options(entry_options(raw)),
                        "ptx_sha256": digest,
                        "stored_sha256": hashlib.sha256(
                            data[entry.offset:entry.offset + entry.stored_size]).hexdigest(),
                        "ptx_bytes": len(ptx), "kernels": len(ENTRY.findall(ptx))})
                found = [r for r in rows if (r["platform"], r["file"]) == (platform, member)]
                print(f"{wheel.name} {member}: {len(found)} module(s)", flush=True)
    (args.out / "manifest.json").write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} modules, {len({r['ptx_sha256'] for r in rows})} distinct")


if __name__ == "__main__":
    main()
