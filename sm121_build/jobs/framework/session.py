"""A run's session: its record (written however the run ends, with the step times), the
pipeline on the engine, and a temp folder that goes with it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sm121_build.core.console import Steps, results_to_stderr
from sm121_build.core.interrupts import temp_dir
from sm121_build.cuda.binary import DEFAULT_POLICY, Policy
from sm121_build.cuda.compat import ArchList
from sm121_build.jobs.framework.pipeline import Keys, Pipeline
from sm121_build.jobs.framework.run_record import new_record, recorded


@dataclass(frozen=True)
class Reporting:
    """Where a run's record goes: `--report` (JSON), `--summary-md` (Markdown), `--json`
    (stdout)."""

    report: Path | None = None
    summary_md: Path | None = None
    as_json: bool = False


@dataclass(frozen=True)
class Serving:
    """What a run is for: the arch list its record names (None for inject: its files say),
    the GPU it serves (`--gpu`) and its kernels images' keys, given to the run's pipeline
    when it is made, here and nowhere else."""

    arch: ArchList | None
    gpu: Policy = DEFAULT_POLICY
    keys: Keys = field(default_factory=Keys)


@contextmanager
def run_session(command: str, base: str, tag: str, serving: Serving,
                reporting: Reporting = Reporting()) -> Iterator[tuple[Pipeline, Path]]:
    """A run of the main job, inject or aot: its record, the pipeline on the engine serving
    the run's GPU, and a temp folder; `--json` moves the result lines to stderr."""
    if reporting.as_json:
        results_to_stderr()
    steps = Steps()
    arch = serving.arch
    with recorded(new_record(command, base, tag, arch),
                  reporting.report,
                  reporting.summary_md, steps, reporting.as_json) as record, \
            temp_dir("sm121-run-") as tmp:
        pipeline = Pipeline.connect(record, steps, serving.gpu, serving.keys)
        record.serves(str(serving.gpu))
        yield pipeline, Path(tmp)
