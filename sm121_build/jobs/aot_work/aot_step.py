"""The main job's `aot` action: an extension whose only gain is JIT-only kernels with PTX in
the stock file gets SASS from that PTX (`jobs/aot_work/aot_files.py`), with no source, CUTLASS or
flash-attention: the stock files are read out of the image (never the whole image), rewritten
on this machine with NVIDIA's ptxas, verified against the stock files, and copied into the
pristine base by the pipeline's tail like any built file.

ptxas runs here, not in a stage FROM the base: the PTX entries are zstd-compressed, which a
base's own Python (3.12) cannot read, and what runs on this machine is only the ptxas the user
installed (the newest of `$CUDA_HOME`, `PATH`, PyPI's nvidia-cuda-nvcc, /usr/local/cuda),
never a program of the image.  A module whose PTX is newer than that ptxas reads is an error
that names the ptxas it needs and the command that brings it.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

from sm121_build import __version__
from sm121_build.core.console import note
from sm121_build.core.errors import Sm121Error
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.paths import cache_dir
from sm121_build.core.units import human_size
from sm121_build.cuda.binary import AotAble, BinaryReport, aot_able
from sm121_build.cuda.compat import DEFAULT_TARGET, Target
from sm121_build.cuda.ptxas import Toolchain, find_toolchain
from sm121_build.image.api import ImageEngine
from sm121_build.jobs.aot_work.aot_files import AotRequest, run_aot

AOT_TIMEOUT = 3600.0


@dataclass(frozen=True)
class AotAction:
    """One extension the main job makes native by aot."""

    name: str  # the file, by its path under the vLLM package
    able: AotAble

    def line(self) -> str:
        kernels = f"{self.able.kernels} JIT-only kernel(s)" if self.able.kernels is not None \
            else "its JIT-only kernels"
        return (f"{self.name}: aot ({kernels} in {self.able.fatbins} fatbin(s) get SASS from "
                f"the stock file's own PTX, {human_size(self.able.ptx_bytes)}; "
                f"{self.able.cost.words()}; no source needed)")

    def as_record(self, before: dict[str, int]) -> dict[str, object]:
        gained = self.able.kernels or 0
        after = {"native": before["native"] + gained, "jit": before["jit"] - gained,
                 "none": before["none"]}
        return {"name": self.name, "target": self.name.rsplit("/", 1)[-1].split(".")[0],
                "before": before, "after": after, "build": True, "action": "aot",
                "reason": self.line().split(": ", 1)[1], "remains": []}


def aot_actions(stock: dict[str, BinaryReport | None],
                target: Target = DEFAULT_TARGET) -> tuple[AotAction, ...]:
    """Every stock extension with fatbins the GPU could only JIT but that carry PTX."""
    found = []
    for name, report in sorted(stock.items()):
        able = aot_able(report, target) if report is not None else None
        if able is not None:
            found.append(AotAction(name, able))
    return tuple(found)


def aot_toolchain() -> Toolchain:
    """This machine's ptxas, found before any work (one line when there is none)."""
    return find_toolchain(None)


def aot_key(image_id: str, actions: tuple[AotAction, ...], toolchain: Toolchain,
            target: Target = DEFAULT_TARGET) -> str:
    """What makes an aot the same aot: the base (its ID covers the stock files), the files,
    ptxas's version, the GPU and this tool."""
    parts = [image_id, "aot", toolchain.version, str(target), __version__,
             *(a.name for a in actions)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class AotJob:
    """What one aot compiles: the base (its image ID and vLLM's package folder there), the
    actions, and the ptxas that compiles them."""

    image_id: str
    package_dir: str
    actions: tuple[AotAction, ...]
    toolchain: Toolchain
    target: Target = DEFAULT_TARGET


def compile_into(engine: ImageEngine, job: AotJob, dest: Path) -> None:
    """Read the stock files out of the image and write their aot'd copies under `dest`, at
    their paths under the package; any file left as it was is an error (nothing is tagged)."""
    image_id, package_dir, actions, toolchain = job.image_id, job.package_dir, job.actions, \
        job.toolchain
    with temp_dir("sm121-aot-") as tmp:
        stock = Path(tmp) / "stock"
        with engine.reader(image_id) as files:
            for action in actions:
                local = stock / action.name
                local.parent.mkdir(parents=True, exist_ok=True)
                found = files.copy_file(posixpath.join(package_dir, action.name), local)
                if found is None:
                    raise Sm121Error(f"{posixpath.join(package_dir, action.name)} vanished "
                                     "from the image")
                local.chmod(found.mode & 0o7777)  # the aot'd file keeps the stock file's mode
        outcome = run_aot(AotRequest((stock,), dest, job.target, toolchain,
                                     len(os.sched_getaffinity(0)), AOT_TIMEOUT,
                                     cache_dir() / "aot"))
    for item in outcome.files:
        note(f"aot {item.name.split('/stock/', 1)[-1]}: {item.modules} module(s), "
             f"+{human_size(item.entry_bytes)} ({human_size(item.sass_bytes)} of SASS)")
    if outcome.failed:
        more = f" (and {len(outcome.failed) - 1} more)" if len(outcome.failed) > 1 else ""
        raise Sm121Error(f"aot could not make every planned file native: "
                         f"{outcome.failed[0]}{more}")
    note(f"aot: {outcome.cpu_seconds:,.0f} CPU-s of ptxas with {toolchain}")
