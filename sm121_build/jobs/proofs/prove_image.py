"""`sm121-build prove IMAGE`: the proof of an image the main job made, on this machine's GPU,
through the engine.

1. IMAGE's labels say what the tool placed (`extensions`), from what base (its digest) and
   for which GPU; an image without them is refused (it was not made by this tool).
2. Each placed file is read from IMAGE and its stock copy from the base, as verification
   reads them (a container created, never started); neither image is run for it.
3. Every child of `proving` runs in a throwaway container of IMAGE given the GPU by the
   engine's device request (`docker run --gpus all`): no network, a read-only root, as this
   user, the payload scripts and the stock copies mounted read-only, one scratch folder
   writable.  The native harness runs open IMAGE's own files where they are.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from sm121_build.core.children import KEPT, Ended
from sm121_build.core.console import note, shown
from sm121_build.core.errors import Sm121Error
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.labels import FIELD_LABELS
from sm121_build.cuda.compat import DEFAULT_GPU, Target, parse_target
from sm121_build.image.api import Bind, GpuJob, ImageEngine, ImageFiles
from sm121_build.image.facts import ImageFacts
from sm121_build.image.refs import validate_image_ref
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.jobs.proofs.prove_child import Asked, Jit, Said, heard
from sm121_build.jobs.proofs.prove_document import LeftOut, Proof, Subject
from sm121_build.jobs.proofs.proving import (
    DRIVER_DEFAULTS,
    NO_STOCK,
    PAYLOADS,
    Pair,
    ProveRequest,
    driver_settings,
    prove_pairs,
)

PAYLOAD_AT = "/sm121-prove/payload"  # the payload scripts, read-only
INPUTS_AT = "/sm121-prove/inputs"  # the stock copies, this host's copies, the cubins: read-only
WORK_AT = "/sm121-prove/work"  # the only folder a child writes: its outputs, its HOME
MAX_NAMES = 4096
MAX_PLACED = 8 << 30  # bytes of one placed file: vLLM's largest .so is well under 1 GB
MAX_LABEL = 64 * 1024
# a placed file's name: relative, plain segments (none starting with a dot), a shared library
_PLACED = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}/){0,32}"
                     r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}\.so(?:\.[0-9]+){0,4}\Z", re.ASCII)


_BY_CONTENT = re.compile(r"(?:^|@)sha256:[0-9a-f]{64}\Z", re.ASCII)


@dataclass(frozen=True)
class MadeImage:
    """What an image this tool made says of itself (its labels, checked)."""

    names: tuple[str, ...]  # the files placed (built and aot'd), under vLLM's package or /
    base: str  # the stock image, by digest
    serves: Target


def _label(facts: ImageFacts, field: str, required: bool = True) -> str:
    value = facts.labels.get(FIELD_LABELS[field], "")
    if not value and not required:
        return ""
    if not value:
        raise Sm121Error(f"{shown(facts.ref)} has no {FIELD_LABELS[field]} label: it was not "
                         "made by sm121-build (prove IMAGE proves an image the main job or "
                         "inject made; --files DIR --stock DIR proves files)")
    if len(value) > MAX_LABEL:
        raise Sm121Error(f"{shown(facts.ref)}: its {FIELD_LABELS[field]} label is "
                         f"{len(value)} characters long: not one this tool writes")
    return value


def made_image(facts: ImageFacts) -> MadeImage:
    """The image's own account of what the tool placed, each value checked before use."""
    listed = f"{_label(facts, 'extensions')},{_label(facts, 'aot', required=False)}".split(",")
    names = tuple(dict.fromkeys(n for n in listed if n))
    bad = next((n for n in names if not _PLACED.match(n)), None)
    if bad is not None or not names or len(names) > MAX_NAMES:
        what = f"names {shown(bad)!r}" if bad is not None else f"lists {len(names)} files"
        raise Sm121Error(f"{shown(facts.ref)}: its {FIELD_LABELS['extensions']} label {what}, "
                         "not a relative .so path of the image: not one this tool writes")
    base = _label(facts, "base_digest")
    try:
        validate_image_ref(base)
    except Sm121Error:
        raise Sm121Error(f"{shown(facts.ref)}: its base label {shown(base)!r} is not an "
                         "image reference") from None
    if not _BY_CONTENT.search(base):  # a repository digest, or the ID of a local image
        raise Sm121Error(f"{shown(facts.ref)}: its base label {shown(base)} names no digest: "
                         "the stock files must come from exactly the image it was made from")
    gpu = _label(facts, "gpu", required=False) or DEFAULT_GPU  # made before --gpu: a Spark's
    return MadeImage(names, base, parse_target(gpu))


@dataclass(frozen=True)
class ImageChildren:
    """prove's children in throwaway containers of `image_id` with the GPU: each given the
    `binds`, run as this user, for at most `seconds`."""

    engine: ImageEngine
    image_id: str
    python: str
    seconds: float
    binds: tuple[Bind, ...]

    @property
    def jobs(self) -> int:
        """One container at a time (the engine's calls are not made from threads)."""
        return 1

    def talk(self, args: tuple[str, ...], what: str, jit: Jit, asked: Asked,
             seconds: float | None = None) -> tuple[Ended, Said]:
        # the image's own environment, with the driver's variables said outright (an ENV of
        # the image's own that forces or disables the JIT, CUDA 12's CUDA_FORCE_JIT too, is
        # set back to the default), then as `driver_settings` says for this child
        driver = {**DRIVER_DEFAULTS, **driver_settings(jit)}
        env = (*driver.items(), ("HOME", f"{WORK_AT}/home"),
               ("TMPDIR", f"{WORK_AT}/home"), ("PYTHONDONTWRITEBYTECODE", "1"))
        done = self.engine.run_with_gpu(self.image_id, GpuJob(
            what, (self.python, *args), env, min(seconds or self.seconds, self.seconds),
            self.binds, f"{os.getuid()}:{os.getgid()}"))
        stdout, stderr = done.stdout.encode(), done.stderr.encode()
        dropped = max(0, len(stdout) - KEPT) + max(0, len(stderr) - KEPT)
        said = heard(stdout, asked, what)
        return Ended(-9 if done.status is None else done.status, stdout[-KEPT:],
                     stderr[-KEPT:], dropped, done.status is None, 0.0, 0), said

    def at(self, path: Path) -> str:
        """Where a child sees `path`: under the bind that holds it."""
        for bind in self.binds:
            if path.is_relative_to(bind.host):
                return posixpath.join(bind.inside, path.relative_to(bind.host).as_posix())
        raise AssertionError(f"{path} is in no folder the container is given")


def _placed_path(files: ImageFiles, package: str, name: str) -> str:
    """Where a placed name lies in an image: under vLLM's package, else from / (a file of
    another package, `aot --all-packages`)."""
    under = posixpath.join(package, name)
    return under if files.stat(under) is not None else "/" + name


def copy_pairs(engine: ImageEngine, image: ImageFacts, base_id: str, made: MadeImage,
               inputs: Path) -> tuple[list[Pair], list[LeftOut]]:
    """Each placed file (from IMAGE) and its stock copy (from the base) under `inputs`; a
    name the base lacks is said and left out (nothing of it to compare: not proven)."""
    vllm = image.vllm
    if vllm is None:
        raise Sm121Error(f"{shown(image.ref)} has no vLLM")
    pairs, left_out = [], []
    with engine.reader(image.id) as mine, engine.reader(base_id) as base:
        for name in made.names:
            where = _placed_path(mine, vllm.package_dir, name)
            for files, image_ref in ((mine, image.ref), (base, made.base)):
                found = files.resolve(where)
                if found is not None and found.size > MAX_PLACED:
                    raise Sm121Error(f"{shown(image_ref)}: {shown(where)} is {found.size:,} "
                                     f"bytes, more than the {MAX_PLACED:,} a placed file may "
                                     "be")
            new, stock = inputs / "files" / name, inputs / "stock" / name
            new.parent.mkdir(parents=True, exist_ok=True)
            stock.parent.mkdir(parents=True, exist_ok=True)
            if mine.copy_file(where, new) is None:
                raise Sm121Error(f"{shown(image.ref)} lacks {shown(where)}, which its "
                                 "labels say the tool placed")
            if base.copy_file(where, stock) is None:
                note(f"{shown(name)}: the base has no {shown(where)}: nothing to compare it "
                     "with, not proven")
                new.unlink()
                left_out.append(LeftOut(name, NO_STOCK))
                continue
            pairs.append(Pair(name, new, stock, where))
    return pairs, left_out


def run_prove_image(ref: str, python: str, seconds: float) -> Proof:
    """The proof of IMAGE on this machine's GPU; refused in one line (not made by this tool,
    its base not here, an engine with no GPU to give, another GPU) before any op runs."""
    pipeline = Pipeline.connect()
    facts, _vllm = pipeline.resolve_image(ref)  # never pulled: the image this user has
    made = made_image(facts)
    engine = pipeline.engine
    base_id = engine.image_id(made.base)
    if base_id is None:
        raise Sm121Error(f"{shown(ref)} was made from {shown(made.base)}, which is not in the "
                         "engine: the stock files are read from it (`docker pull "
                         f"{shown(made.base)}`, then prove again)")
    with temp_dir("sm121-prove-") as tmp:
        inputs, work = tmp / "inputs", tmp / "work"
        (work / "home").mkdir(parents=True)
        pairs, left_out = copy_pairs(engine, facts, base_id, made, inputs)
        children = ImageChildren(engine, facts.id, python, seconds, (
            Bind(PAYLOADS, PAYLOAD_AT), Bind(inputs, INPUTS_AT),
            Bind(work, WORK_AT, writable=True)))
        subject = Subject(image=ref, image_id=facts.id, base=made.base)
        (inputs / "cubins").mkdir()  # mounted read-only: no child can plant a link there
        return prove_pairs(ProveRequest(tuple(pairs), children, subject, made.serves,
                                        tuple(left_out)), work, inputs / "cubins")
