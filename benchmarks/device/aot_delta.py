"""Carry an aot'd file to a machine that has its stock file as the difference alone: the
fatbin entries aot added, per container.  The lent GPU machine takes 64 MiB a call; vLLM's
FA2 is 190 MB stock and ~217 MB aot'd, of which the added SASS is ~27 MB (zstd).

    python3 aot_delta.py make STOCK.so AOT.so DELTA      (here)
    python3 aot_delta.py apply STOCK.so DELTA RESULT.so  (there; prints RESULT's sha256)

`apply` rebuilds the aot'd file with the tool's own rewrite (`cuda/fatbin_rewrite.rewrite`,
deterministic), so RESULT is byte for byte the file aot wrote: its sha256 is checked against
the manifest the main job wrote (`main_job_proof.sh`).  DELTA: a JSON line (containers and
entry sizes) then the entries' bytes.
"""
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sm121_build.cuda.fatbin_rewrite import read_layout, rewrite


def make(stock: Path, aot: Path, delta: Path) -> None:
    before = read_layout(stock.read_bytes(), str(stock))
    after = read_layout(aot.read_bytes(), str(aot))
    order = [r.container for r in before.registrations]
    added = []
    for position, registration in enumerate(after.registrations):
        old = before.containers[order[position]]
        new = after.containers[registration.container]
        extra = new.entries[len(old.entries):]
        if extra:
            added.append((order[position], extra))
    head = [{"container": c, "sizes": [len(e) for e in extra]} for c, extra in added]
    with open(delta, "wb") as out:
        out.write(json.dumps(head).encode() + b"\n")
        for _c, extra in added:
            for entry in extra:
                out.write(entry)
    print(f"{delta}: {len(added)} container(s), {delta.stat().st_size} bytes")


def apply(stock: Path, delta: Path, result: Path) -> None:
    data = stock.read_bytes()
    layout = read_layout(data, str(stock))
    raw = delta.read_bytes()
    line, _, body = raw.partition(b"\n")
    replaced, at = {}, 0
    for row in json.loads(line):
        entries = []
        for size in row["sizes"]:
            entries.append(body[at:at + size])
            at += size
        index = row["container"]
        replaced[index] = (*layout.containers[index].entries, *entries)
    new = rewrite(data, layout, replaced)
    result.write_bytes(new)
    print(json.dumps({"file": result.name, "sha256": hashlib.sha256(new).hexdigest()}))


if __name__ == "__main__":
    verb, *paths = sys.argv[1:]
    (make if verb == "make" else apply)(*map(Path, paths))
