"""The ELF machines this tool names (an ELF header's `e_machine` -> its name): the one table,
read by the host-side reader (`host.py`) and the fatbin rewrite (`fatbin_rewrite.py`)."""

from __future__ import annotations

EM_X86_64, EM_AARCH64 = 62, 183
MACHINES = {3: "i386", EM_X86_64: "x86_64", EM_AARCH64: "aarch64", 190: "cuda", 40: "arm"}
