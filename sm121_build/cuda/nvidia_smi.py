"""This machine's GPU and driver, as nvidia-smi names them: what `audit` judges for when the
user names no `--target`/`--driver`, and what `doctor` checks."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from sm121_build.core.children import Program, run
from sm121_build.core.console import note

QUERY = ("--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader")
SmiRunner = Callable[[list[str]], "str | None"]


@dataclass(frozen=True)
class HostGpu:
    name: str
    capability: str  # "12.1"
    driver: str  # "580.95.05"
    cuda: str | None  # the newest CUDA the driver runs (and JITs), from nvidia-smi's banner

    @property
    def target(self) -> str | None:
        """`sm_121` for compute capability `12.1`; None for anything not of that form (a
        driver version in the wrong column is no GPU)."""
        found = re.fullmatch(r"(\d{1,2})\.(\d)", self.capability.strip(), re.ASCII)
        return f"sm_{found.group(1)}{found.group(2)}" if found else None


SMI_S = 5.0  # nvidia-smi answers in well under a second where NVML is up


def output(args: list[str]) -> str | None:
    """A command's stdout, or None when it cannot run, fails or hangs (then said once: the
    run goes on as on a machine with no GPU, judged for the default GPU)."""
    try:
        done = run(Program(tuple(args), SMI_S, "nvidia-smi"))
    except OSError:
        return None
    if done.timed_out:
        note(f"note: nvidia-smi gave no answer in {SMI_S:g} s: this machine's GPU is not "
             "known (judged as on one with none)")
    return done.text if done.returncode == 0 and not done.timed_out else None


def read(smi: str, run: SmiRunner = output) -> HostGpu | None:
    """The first GPU nvidia-smi lists, or None when it lists none (or fails)."""
    rows = run([smi, *QUERY])
    if not rows:
        return None
    header = run([smi]) or ""
    name, cap, driver = (part.strip() for part in [*rows.splitlines()[0].split(","), "", ""][:3])
    return HostGpu(name, cap, driver, driver_cuda(header))


def driver_cuda(header: str) -> str | None:
    """The CUDA version nvidia-smi's banner names: the newest the driver runs (and JITs)."""
    marker = "CUDA Version:"
    words = header.split(marker, 1)[1].split() if marker in header else []
    # a banner cut at the marker (a lying nvidia-smi, or the children door's bound) names none
    if words and re.fullmatch(r"\d+(\.\d+)*", words[0], re.ASCII):
        return words[0]
    return None


def gpu_defaults(which: Callable[[str], str | None] = shutil.which,
                 run: SmiRunner = output) -> tuple[str | None, str | None]:
    """(target, driver CUDA version) of this machine's GPU; (None, None) without one."""
    smi = which("nvidia-smi")
    found = read(smi, run) if smi else None
    return (found.target, found.cuda) if found else (None, None)
