"""`sm121-build prove IMAGE` and `prove --files DIR --stock DIR`: on the GPU's machine, the
cubins the tool added load natively and the ops they serve compute what the stock files
compute by the JIT."""

from __future__ import annotations

import os
from pathlib import Path

import click

from sm121_build.cli.params import (
    Count,
    InputPath,
    interpreter_value,
    require_writable,
    seconds_value,
    sign_key_option,
    signing_key,
)
from sm121_build.core.errors import Sm121Error, VerificationError
from sm121_build.image.refs import validate_image_ref

DEFAULT_TIMEOUT = "1800"  # per child: FA2's stock JIT took 88 s for five configs on an H100
MOST_JOBS = 16  # the default's cap: each process holds a CUDA context and torch


def _default_jobs() -> int:
    return min(len(os.sched_getaffinity(0)), MOST_JOBS)


@click.command()
@click.argument("image", required=False)
@click.option("--files", "files", type=InputPath(file_okay=False, path_type=Path),
              help="Instead of IMAGE: the aot'd files (aot's --out), every .so under it with "
                   "a stock file, proven with this host's --python.")
@click.option("--stock", "stock", type=InputPath(file_okay=False, path_type=Path),
              help="With --files: the stock files aot read, at the same paths as under "
                   "--files.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the proof document here (data/schemas/proof.schema.json).")
@click.option("--python", "python", default="python3", show_default=True,
              callback=interpreter_value,
              help="The interpreter the children run under (IMAGE's own, for IMAGE): torch "
                   "(with the CUDA the files were built against) for the harnesses, ctypes "
                   "for the loader.")
@click.option("--timeout", default=DEFAULT_TIMEOUT, callback=seconds_value, metavar="SECONDS",
              show_default=True, help="Seconds one child (a harness run, the loader) may take.")
@click.option("-j", "--jobs", type=Count(1, 256), default=_default_jobs,
              help="Processes a side runs at once for a harness that derives its cases from "
                   "the added kernels (FA2): the stock side's driver JIT spread over the "
                   "cores, each process given whole modules [default: every core, at most "
                   "16; with IMAGE: 1].")
@sign_key_option("With --json: sign the proof with this ECDSA P-256 PEM key (a passphrase "
                   "from COSIGN_PASSWORD), as PROOF.sig beside it (`cosign sign-blob`'s "
                   "form), for `kernels publish --proof PROOF --trust-key`.")
def prove(image: str | None, files: Path | None, stock: Path | None,  # noqa: PLR0913
          json_out: Path | None, python: str, timeout: float, jobs: int,
          sign_key: Path | None) -> None:
    """Prove on this machine's GPU that the cubins the tool added load and compute what the
    stock files compute.

    IMAGE is one the main job (or inject) made: its placed files are proven in place, in
    throwaway containers of IMAGE given the GPU by the engine (`--gpus all`: the NVIDIA
    Container Toolkit), against the stock files of the base it was made from (which must be
    in the engine).  --files DIR --stock DIR proves files on this host instead.

    With the PTX JIT disabled, each cubin a file has and its stock file lacks
    (for this GPU) is loaded by the driver and each of its kernels found by name.  For
    FA2 (`_vllm_fa2_C`: varlen_fwd, fwd_kvcache) and `_C` (the Marlin repack ops), the
    ops run on seeded inputs: the stock file with the driver's JIT (the reference), the
    stock file without it (which must fail), the aot'd file without it; the outputs are
    compared bit for bit and each first call timed.  FA2's cases are derived from the
    kernels the file added (each added kernel's template arguments turned back into the
    inputs that select it), run in --jobs processes a side, the stock side's JIT results
    kept in a fresh cache folder of the run's own; the aot'd file's run records which
    of its added kernels each case launched (torch's profiler).  The verdict is `proven`
    only when every added kernel launched in a case compared bitwise equal; `partial` when
    nothing differs but some were never launched (exit 0, with a `warning: partial: proven
    for X of Y added kernels; Z never launched` line; `kernels publish --proof` refuses it
    without --partial-proof); exit 3 when anything differs or fails.
    """
    from sm121_build.core.console import notice
    from sm121_build.core.outputs import refuse_onto_inputs, replace_bytes
    from sm121_build.jobs.proofs.prove_document import document, say_proof
    from sm121_build.jobs.proofs.proving import HostChildren, run_prove

    if (image is None) == (files is None) or (files is None) != (stock is None):
        raise click.UsageError("give IMAGE, or --files DIR and --stock DIR")
    if image is not None:
        validate_image_ref(image)
    if sign_key is not None and json_out is None:
        raise click.UsageError("--sign-key signs the proof --json writes: give --json FILE")
    signing = None
    if sign_key is not None:
        from sm121_build.image.signed_files import signature_beside, write_signature

        signing = signing_key(sign_key)
    if json_out is not None:
        inputs = (files, stock) if files is not None and stock is not None else ()
        for out in (json_out, *([signature_beside(json_out)] if signing else [])):
            refuse_onto_inputs(out, inputs, "--json")  # before anything is made
            require_writable(out, "--json")
    if files is not None and stock is not None:
        proof = run_prove(files, stock, HostChildren(python, timeout, jobs))
    else:
        from sm121_build.jobs.proofs.prove_image import run_prove_image

        assert image is not None
        proof = run_prove_image(image, python, timeout)
    say_proof(proof)
    if json_out is not None:
        try:
            written = document(proof)
        except ValueError as exc:
            raise Sm121Error(f"--json {json_out}: the proof is not strict JSON ({exc}): not "
                             "written") from None
        replace_bytes(json_out, written)
        if signing is not None:
            write_signature(json_out, written, signing)
    problems = proof.problems()
    if problems:
        raise VerificationError(f"not proven: {len(problems)} problem(s); the first: "
                                f"{problems[0]}")
    if proof.verdict == "partial":
        notice(f"warning: partial: {proof.coverage_line()} (the proof lists them)")
