"""What one hostile attestation costs a reader: a DSSE envelope under the 1 MiB blob bound
holding ~45,000 empty signatures over a ~375 KB payload (issue #62: 8.5 s a blob, 64 such
blobs beside one image ~9 min of CPU, when the PAE was rebuilt and hashed per signature).

Run: python benchmarks/envelope_cost.py [--signatures 45000]

Prints the seconds `cosign`'s reader takes on the blob (`_envelope`, then `_verifies`) and,
measured in the same run on the same blob, the reference: the PAE rebuilt and hashed for
each signature, as the reader did before; then their ratio.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.keys import key_pair  # noqa: E402
from sm121_build.image import cosign  # noqa: E402


def hostile_blob(signatures: int) -> bytes:
    statement = json.dumps({"predicate": {"pad": "x" * 280_000}}).encode()
    return json.dumps({"payloadType": cosign.IN_TOTO,
                       "payload": base64.b64encode(statement).decode(),
                       "signatures": [{"sig": ""}] * signatures},
                      separators=(",", ":")).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signatures", type=int, default=45_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        key = cosign.SigningKey.load(key_pair(Path(folder), "k")[0], None)
        trust = key.public(Path(folder) / "k.pub")
    blob = hostile_blob(args.signatures)
    started = time.perf_counter()
    read = cosign._envelope(blob)
    verified = read is not None and cosign._verifies(trust, read)
    now = time.perf_counter() - started
    started = time.perf_counter()
    envelope = json.loads(blob)
    statement = base64.b64decode(envelope["payload"])
    before = any(trust.signed(cosign.pae(cosign.IN_TOTO, statement), item["sig"])
                 for item in envelope["signatures"])
    reference = time.perf_counter() - started
    print(f"blob: {len(blob):,} bytes, {args.signatures:,} signatures; verified: "
          f"{verified or before}")
    print(f"the reader: {now:.4f} s (envelope {'read' if read else 'not read: too many'}"
          f" signatures); a PAE per signature (before): {reference:.2f} s; "
          f"ratio {reference / now:,.0f}x")


if __name__ == "__main__":
    main()
