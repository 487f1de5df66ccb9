"""`sm121-build prove`: on a machine with the GPU, prove that the cubins a tool run added to
files (aot) load natively and that the ops they serve compute what the stock files compute
through the driver's JIT.

1. The GPU: `load_cubins.py probe` (ctypes on libcuda.so.1, device 0).
2. Per file of --files with the same-named stock file under --stock, the cubins it added
   (`cuda/added.read_added`), written to the run's temp folder; the GPU must load some.
3. Those cubins loaded by the driver, each kernel found by name, with the PTX JIT disabled.
4. Per file a harness serves (`HARNESSES`): the stock file with the JIT (the reference), the
   stock file without it (must fail), the file without it; outputs compared bit for bit.
   The file's run is given its added kernels (`KERNELS.json`): its recorder says which of
   them each case launched (the coverage: `Coverage`, per file; none for a file no harness
   runs, so every one of its added kernels is never launched).  A harness that derives its
   cases from the kernels (FA2's) is given those `prove_cases` derives, in parts run at once
   (`Children.jobs` processes a side); the stock side's driver JIT then keeps what it
   compiles in a cache folder of the run's own, fresh, shared by its processes (never the
   user's, never the native side's).

Every child runs under `--python` (torch for the harnesses, ctypes for the loader) where
`Children` says: on this host through `core.children.run` (`HostChildren`, `--files`), or in
a throwaway container of the image with the GPU (`prove_image.ImageChildren`, `prove IMAGE`).
What it says is parsed as outside input (`prove_child`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Protocol

from sm121_build import __version__
from sm121_build.core.children import Ended, Program, end_groups, running
from sm121_build.core.console import note, shown
from sm121_build.core.errors import (
    HarnessMismatch,
    NoGpu,
    Sm121Error,
    VerificationError,
    WrongGpu,
)
from sm121_build.core.inputs import kind_of, require_folder, sha256_of, walk
from sm121_build.core.vllm import extension_target
from sm121_build.cuda.added import AddedCubin, read_added, trap_stubs
from sm121_build.cuda.compat import Target, cubin_loads
from sm121_build.jobs.payload import PAYLOAD
from sm121_build.jobs.proofs.prove_cases import (
    FAMILIES,
    FIXED_ONLY,
    Dealing,
    DealtCases,
    Modules,
    Part,
    deal_cases,
)
from sm121_build.jobs.proofs.prove_child import (
    JIT_OFF,
    JIT_ON,
    Asked,
    Compared,
    CubinLoad,
    Device,
    Jit,
    Launched,
    Said,
    talk,
)
from sm121_build.jobs.proofs.prove_document import (
    Coverage,
    CubinResult,
    FileProof,
    KernelLaunched,
    LeftOut,
    OpResult,
    Proof,
    StockWithoutJit,
    Subject,
    Unreachable,
)

PAYLOADS = PAYLOAD.parent
LOADER = PAYLOADS / "load_cubins.py"
COMPARE = PAYLOADS / "compare_outputs.py"


@dataclass(frozen=True)
class Harness:
    """A harness of jobs/payload, and whether its cases are derived from the file's added
    kernels (`prove_cases`; otherwise it runs its fixed cases, in one process a side)."""

    script: str
    derives: str | None = None  # the family of prove_cases.FAMILIES its cases come from
    fixed: bool = True  # it has fixed cases (`_moe_C`'s library has no op they call)


# extension target -> its harness, run on a file of that target's name
HARNESSES = {"_vllm_fa2_C": Harness("harness_fa2.py", derives="fa2"),
             "_C": Harness("harness_marlin.py", derives="marlin"),
             "_moe_C": Harness("harness_marlin.py", derives="marlin", fixed=False)}
PROBE_SECONDS = 60.0
# variables that would change what the driver does with PTX: set by `_env` alone (CUDA 12's
# CUDA_FORCE_JIT ignores every cubin as CUDA_FORCE_PTX_JIT does, for PTX and NVVM IR alike;
# CUDA_DISABLE_JIT turns off the reference's JIT)
DRIVER_JIT = ("CUDA_DISABLE_PTX_JIT", "CUDA_FORCE_PTX_JIT", "CUDA_DISABLE_JIT", "CUDA_FORCE_JIT",
              "CUDA_CACHE_DISABLE", "CUDA_CACHE_PATH", "CUDA_CACHE_MAXSIZE")
JIT_CACHE_BYTES = 4 << 30  # the stock side's private cache: room for a whole file's modules
# each of DRIVER_JIT's variables as the driver takes it when it is not set: what an image's
# own ENV of one is set back to where a variable cannot be left out (a container)
DRIVER_DEFAULTS = {"CUDA_DISABLE_PTX_JIT": "0", "CUDA_FORCE_PTX_JIT": "0",
                   "CUDA_DISABLE_JIT": "0", "CUDA_FORCE_JIT": "0", "CUDA_CACHE_DISABLE": "0"}


class Children(Protocol):
    """Where prove's children run: each is given `args` after the interpreter, says its
    lines, and ends by its deadline; `at` is where it sees a path of this host; `jobs`: how
    many may run at once.  `cache`: the driver's JIT cache folder of a JIT run (as the child
    sees it; None: no cache) is part of `jit`."""

    @property
    def python(self) -> str:
        """The interpreter, as messages name it."""
        ...

    @property
    def jobs(self) -> int:
        """How many children may run at once."""
        ...

    def talk(self, args: tuple[str, ...], what: str, jit: Jit, asked: Asked,
             seconds: float | None = None) -> tuple[Ended, Said]: ...

    def at(self, path: Path) -> str: ...


@dataclass(frozen=True)
class HostChildren:
    """The children on this host, under `python` (`--python`), each for at most `seconds`,
    `jobs` at once."""

    python: str
    seconds: float
    jobs: int = 1

    def talk(self, args: tuple[str, ...], what: str, jit: Jit, asked: Asked,
             seconds: float | None = None) -> tuple[Ended, Said]:
        return talk(Program((self.python, *args), min(seconds or self.seconds, self.seconds),
                            what, env=_env(jit)), asked)

    def at(self, path: Path) -> str:
        return str(path)


@dataclass(frozen=True)
class Pair:
    name: str  # the path under --files (under the package, for an image)
    new: Path  # this host's copy: its added cubins are read from it
    stock: Path
    runs_as: str  # the new file as the children open it (an image's own, in place)

    @property
    def sha256(self) -> str:
        """The new file's, read through the door (what a manifest names it by)."""
        return sha256_of(self.new)


@dataclass(frozen=True)
class Extracted:
    """A pair's added cubins, those this GPU loads written to the temp folder; `sha256`: the
    new file's, read as its cubins were, before any child ran (None: read at the end)."""

    pair: Pair
    cubins: tuple[AddedCubin, ...]
    paths: Mapping[int, Path]  # cubin number -> its bytes' file (the GPU's cubins only)
    stubs: Mapping[str, str] = field(default_factory=dict)  # trap stub -> the evidence
    sha256: str | None = None
    number: int = 0  # the pair's place in the run

    @property
    def stem(self) -> str:
        """What the files of the pair's runs are named from: its place in the run, then its
        file's name, cut (no two pairs share one, as `a/b.so` and `a_b.so` shared `a_b.so`,
        and a deep path cannot make a name too long for the file system)."""
        return f"{self.number:04d}-{PurePosixPath(self.pair.name).name[:64]}"

    def proven_sha256(self) -> str:
        """The sha256 the proof names the file by: the one read before the children ran,
        which the file must still have (a file changed while it was proven, by a child or
        by a build into --files, is proven of no bytes: VerificationError)."""
        now = self.pair.sha256
        if self.sha256 is not None and now != self.sha256:
            raise VerificationError(
                f"{shown(self.pair.name)}: changed while it was proven (sha256 "
                f"{self.sha256[:16]}... when its cubins were read, {now[:16]}... after the "
                "runs): no proof is made; prove it again when nothing writes it")
        return now


def driver_settings(jit: Jit) -> dict[str, str]:
    """The one rule for the driver's variables of a child (every other of DRIVER_JIT is
    left to its default): the JIT on or off, and its cache off (a cached JIT result from
    outside the run would hide the JIT's first-call time, and could stand in for a cubin),
    or, for a JIT run given one, the run's own cache folder, made fresh by the run."""
    settings = {"CUDA_CACHE_PATH": jit.cache, "CUDA_CACHE_MAXSIZE": str(JIT_CACHE_BYTES)} \
        if jit.on and jit.cache is not None else {"CUDA_CACHE_DISABLE": "1"}
    if not jit.on:
        settings["CUDA_DISABLE_PTX_JIT"] = "1"
    return settings


def _env(jit: Jit) -> dict[str, str]:
    """A child's environment on this host: ours without any of DRIVER_JIT, then
    `driver_settings`."""
    env = {k: v for k, v in os.environ.items() if k not in DRIVER_JIT}
    return {**env, **driver_settings(jit)}


def _utf8(name: str) -> bool:
    """Whether a path's name is UTF-8 (no byte held as a lone surrogate)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _utf8_text(path: Path) -> str:
    """A path as UTF-8 text for a document: a byte that is not UTF-8 written `\\xff`."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


NO_STOCK = "no stock file to compare it with"
NOT_A_FILE = "not a regular file"
LINK_OUT = "a link out of --files"


def _unreadable(files: Path, new: Path) -> str | None:
    """Why a `.so` under --files is not one to prove: a link that leads out of --files (its
    bytes are not the folder's), or not a regular file (a FIFO, a socket, a device, a
    folder or a broken link); None for a regular file of the folder."""
    if new.is_symlink() and not Path(os.path.realpath(new)).is_relative_to(
            os.path.realpath(files)):
        return LINK_OUT
    return None if kind_of(new) == "file" else NOT_A_FILE


def find_pairs(files: Path, stock: Path) -> tuple[list[Pair], list[LeftOut]]:
    """Each `.so` under --files whose path under --stock is a regular file too; and each
    `.so` left out, said: one with no stock file (with the proof), one that is not a regular
    file or a link out of --files (`_unreadable`: here, in a note, and with the proof)."""
    require_folder(files, "--files")
    require_folder(stock, "--stock")
    pairs, left_out = [], []
    for folder, dirnames, filenames in walk(files):
        dirnames.sort()
        for filename in sorted(filenames):
            if not filename.endswith(".so"):
                continue
            new = Path(folder) / filename
            name = new.relative_to(files).as_posix()
            if not _utf8(name):  # a proof, and a manifest, name their files in UTF-8
                raise Sm121Error(f"--files {shown(_utf8_text(files))}: {shown(name)} is not a "
                                 "UTF-8 name: a proof names each file as UTF-8 text (rename "
                                 "it, or prove the files without it)")
            why = _unreadable(files, new)
            if why is not None:
                note(f"--files {shown(_utf8_text(files))}/{shown(name)}: {why}: not proven")
                left_out.append(LeftOut(name, why))
                continue
            if kind_of(stock / name) == "file":
                pairs.append(Pair(name, new, stock / name, str(new)))
            else:  # said with the proof (`say_proof`), and in it
                left_out.append(LeftOut(name, NO_STOCK))
    return pairs, left_out


def probe(children: Children) -> Device:
    """The GPU (device 0), or NoGpu in one line: no libcuda, cuInit failed, no device."""
    try:
        ended, said = children.talk((children.at(LOADER), "probe"), "the CUDA driver probe",
                                    jit=JIT_OFF, asked=Asked(), seconds=PROBE_SECONDS)
    except OSError as exc:
        raise Sm121Error(f"--python {children.python}: cannot be run "
                         f"({exc.strerror or exc})") from None
    if said.device is None or ended.returncode != 0:
        why = said.error or ("timed out" if ended.timed_out else ended.said(200))
        raise NoGpu(f"no GPU to prove on: {why} (prove runs on the machine with the GPU the "
                    "files were made for)")
    return said.device


def extract(pairs: list[Pair], gpu: Target, folder: Path, subject: Subject) -> list[Extracted]:
    """Every pair's added cubins; the bytes of those the GPU loads, written under `folder`.
    Refused when no file added a cubin, or none the GPU loads."""
    found = []
    for number, pair in enumerate(pairs):
        paths: dict[int, Path] = {}
        stubs: dict[str, str] = {}

        def keep(cubin: AddedCubin, payload: bytes, at: int = number,
                 into: dict[int, Path] = paths, traps: dict[str, str] = stubs) -> None:
            if cubin.loads_on(gpu):
                into[cubin.number] = folder / f"{at:04d}-{cubin.number:05d}.cubin"
                into[cubin.number].write_bytes(payload)
                kernels = set(cubin.kernels)
                traps.update((name, why) for name, why in
                             trap_stubs(payload, cubin.entry.arch).items() if name in kernels)

        before = pair.sha256
        cubins = read_added(pair.stock, pair.new, keep)
        if cubins:
            found.append(Extracted(pair, cubins, paths, stubs, before, number))
    if not found:
        raise Sm121Error(f"no file of {shown(str(subject))} has cubins its stock file lacks: "
                         "nothing to prove (give aot's --out and the stock files it read, or "
                         "an image the main job made)")
    if not any(e.paths for e in found):
        made = sorted({c.sm for e in found for c in e.cubins})
        raise WrongGpu(f"the files' added cubins are for {', '.join(made)}; this GPU is "
                       f"{gpu} (compute capability {gpu.major}.{gpu.minor}): prove them on "
                       "the GPU they were made for")
    return found


def load_all(children: Children, extracted: list[Extracted], folder: Path
             ) -> dict[str, CubinLoad]:
    """Every added cubin the GPU loads, loaded by the driver with the JIT disabled."""
    items = [{"id": path.stem, "path": children.at(path),
              "kernels": list(next(c for c in e.cubins if c.number == n).kernels)}
             for e in extracted for n, path in e.paths.items()]
    listing = folder / "cubins.json"
    listing.write_text(json.dumps(items))
    asked = Asked(cubins={str(item["id"]): frozenset(item["kernels"]) for item in items})
    ended, said = children.talk((children.at(LOADER), "load", children.at(listing)),
                                "the cubin loader", jit=JIT_OFF, asked=asked)
    if said.device is None:
        raise NoGpu(f"no GPU to prove on: {said.error or ended.said(200)}")
    if said.done != len(items) or ended.timed_out or ended.returncode != 0:
        note(f"the loader answered {len(said.loads)} of {len(items)} cubin(s) and "
             f"{'ran past --timeout' if ended.timed_out else f'exited {ended.returncode}'}"
             f" ({ended.said(200)})")
    return {load.cubin: load for load in said.loads}


def added_kernels(item: Extracted) -> frozenset[str]:
    """The file's added kernels for this GPU: every kernel of the cubins it loads, by name."""
    return frozenset(kernel for cubin in item.cubins if cubin.number in item.paths
                     for kernel in cubin.kernels)


def coverage(item: Extracted, launched: list[Launched], ops: list[OpResult],
             recorder: str | None, dead: Mapping[str, str] | None = None) -> Coverage:
    """Of the file's added kernels: those a case launched, those a case launched whose
    output was bitwise equal to the stock JIT's, those never launched, and of these the
    unreachable ones, with the evidence: the trap stubs (any launch of one traps) and
    `dead`, those the op's dispatch never selects on this GPU."""
    added = added_kernels(item)
    equal = {f"{op.op}/{op.case}" for op in ops if op.bitwise_equal and op.error is None}
    ran = {one.kernel for one in launched if one.kernel in added}
    compared = {one.kernel for one in launched if one.kernel in added and one.case in equal}
    why = {**(dead or {}), **item.stubs}
    unreachable = sorted(name for name in added - ran if name in why)
    return Coverage(len(added), len(ran), len(compared),
                    tuple(sorted(added - ran - set(unreachable))),
                    tuple(Unreachable(name, why[name]) for name in unreachable),
                    recorder=recorder)


def file_result(item: Extracted, loads: Mapping[str, CubinLoad], harness: str | None,
                covered: Coverage, launched: frozenset[str] = frozenset()) -> FileProof:
    """The file's result: per added cubin this GPU loads, what the driver did and how many
    of its kernels a case launched (`launched`: the file's added kernels launched)."""
    results = []
    for cubin in item.cubins:
        path = item.paths.get(cubin.number)
        if path is None:
            continue
        load = loads.get(path.stem, CubinLoad(path.stem, False, error="the loader did not "
                                              "answer for it"))
        if load.found > len(cubin.kernels):  # a loader's count past what it was given
            load = CubinLoad(path.stem, False, error=f"the loader said it found {load.found} "
                             f"of {len(cubin.kernels)} kernel(s)")
        results.append(CubinResult(cubin.number, cubin.sm, cubin.entry.container,
                                   len(cubin.kernels), load.loaded, load.found, load.missing,
                                   load.missing_count, load.error,
                                   len(launched & set(cubin.kernels))))
    return FileProof(item.pair.name, tuple(results), len(item.cubins) - len(results), harness,
                      item.proven_sha256(), covered)


@dataclass(frozen=True)
class HarnessRun:
    """One run of a harness: how it ended and what it said."""

    ended: Ended
    said: Said

    def failure(self) -> str:
        """Why it did not complete, in one line."""
        errors = [c for c in self.said.cases if c.error]
        if errors:
            return f"{errors[0].op} {errors[0].case}: {errors[0].error}"
        if self.ended.timed_out:
            return "timed out"
        return f"exit {self.ended.returncode}: {self.ended.said(200)}"


@dataclass(frozen=True)
class HarnessCall:
    """One run of a harness: the library as the child opens it, where it saves its outputs,
    the driver's JIT on or off, and the listing of added kernels whose launches it records
    (the native run's)."""

    so: str
    out: Path
    jit: bool
    listing: Path | None = None
    part: Part = FIXED_ONLY.parts[0]
    cache: Path | None = None  # the JIT run's cache folder


def _harness(children: Children, script: str, call: HarnessCall,
             asked: Asked | None = None) -> HarnessRun:
    """One run of a harness; `asked`: the `OP/CASE` keys it may answer and the added kernels
    it may say launched (None: any case, within the budget: the stock JIT run says what the
    cases are)."""
    args: tuple[str, ...] = (children.at(PAYLOADS / script), call.so, children.at(call.out))
    if call.listing is not None:
        args = (*args, children.at(call.listing))
    cases = call.part.cases
    args = (*args, *call.part.options(None if cases is None else children.at(cases)))
    cache = None if call.cache is None else children.at(call.cache)
    ended, said = children.talk(args, f"the {script} harness", Jit(call.jit, cache),
                                asked or Asked(cases=None))
    if said.schema_error is not None:
        raise HarnessMismatch(f"{call.so}: {said.schema_error}; the {script} harness does not "
                              "fit this library's ops")
    return HarnessRun(ended, said)


@dataclass(frozen=True)
class OpsProven:
    """A file's op cases, its stock run without the JIT, the kernels the native run's
    recorder said each case launched (`recorder`: why it recorded none, where it said), and
    the added kernels no op can launch on this GPU, with the evidence (`dead`)."""

    results: list[OpResult]
    without: StockWithoutJit | None  # None: no case ran (none of the harness serves it)
    launched: list[Launched]
    recorder: str | None
    dead: Mapping[str, str] = field(default_factory=dict)


def _joined(runs: list[HarnessRun]) -> HarnessRun:
    """The runs of a side's parts as one: their cases and launches in order, the outputs
    they saved (None: no part saved any), and how the first that failed ended."""
    if len(runs) == 1:
        return runs[0]
    saved = [run.said.saved for run in runs if run.said.saved is not None]
    said = replace(runs[0].said, cases=[c for run in runs for c in run.said.cases],
                   launched=[one for run in runs for one in run.said.launched],
                   saved=sum(saved) if saved else None,
                   recorder=next((r.said.recorder for r in runs if r.said.recorder), None))
    failed = [run.ended for run in runs if run.ended.returncode != 0 or run.ended.timed_out]
    return HarnessRun((failed or [runs[0].ended])[0], said)


def _side(children: Children, script: str, calls: list[HarnessCall],
          asked: list[Asked | None]) -> list[HarnessRun]:
    """The runs of one side's parts, at most `children.jobs` at once; a line as each part
    ends (how many cases so far, the time), when there are several."""
    if len(calls) == 1:
        return [_harness(children, script, calls[0], asked[0])]
    started, cases = time.monotonic(), 0
    side = "the stock JIT" if calls[0].jit else "the native"
    runs: dict[int, HarnessRun] = {}
    before = running()
    with ThreadPoolExecutor(max(1, min(children.jobs, len(calls)))) as pool:
        futures = {pool.submit(_harness, children, script, call, ask): n
                   for n, (call, ask) in enumerate(zip(calls, asked, strict=True))}
        try:
            for future in as_completed(futures):
                runs[futures[future]] = run = future.result()
                cases += len(run.said.cases)
                spent = time.monotonic() - started
                left = len(calls) - len(runs)
                eta = f", about {spent / len(runs) * left:.0f} s left" if left else ""
                note(f"{script}: {side} side: {len(runs)} of {len(calls)} part(s) done, "
                     f"{cases:,} case(s) in {spent:.0f} s{eta}")
        except BaseException:  # a part refused, or an interrupt: its siblings' work is moot
            for future in futures:
                future.cancel()
            end_groups(running() - before)  # their runs return at once, not at --timeout
            raise
    return [runs[n] for n in range(len(calls))]


def _dealt_cases(item: Extracted, harness: Harness, device: Device | None,
                 children: Children, ours: Path) -> DealtCases:
    """How the file's cases are split: derived from its added kernels and dealt by module
    (a deriving harness, on a GPU the loader described), or the harness's fixed ones."""
    if not harness.derives or device is None:
        return FIXED_ONLY
    into = ours / f"{item.stem}.cases"
    into.mkdir()
    loaded = [cubin for cubin in item.cubins if cubin.number in item.paths]
    modules = Modules({kernel: cubin.number for cubin in loaded for kernel in cubin.kernels},
                      {cubin.number: cubin.entry.size for cubin in loaded})
    dealt = deal_cases(FAMILIES[harness.derives], sorted(added_kernels(item)), modules, device,
                       Dealing(children.jobs, into))
    if dealt.said:
        note(f"{shown(item.pair.name)}: {dealt.said}")
    if dealt.derives:
        note(f"{shown(item.pair.name)}: {dealt.derived:,} case(s) derived from its added "
             f"kernels, in {len(dealt.parts)} part(s); {len(dealt.dead):,} kernel(s) no op "
             "launches on this GPU")
    return dealt


@dataclass(frozen=True)
class Folders:
    """Where a run's files go: `children`, the folder the children write their outputs to;
    `ours`, one they cannot write (what this process gives them to read)."""

    children: Path
    ours: Path


def prove_ops(children: Children, item: Extracted, harness: Harness, folders: Folders,
              device: Device | None = None) -> OpsProven:
    """A harness on the stock file with the JIT, the stock file without it, the new file
    without it (its added kernels' launches recorded); the outputs compared.  The kernels'
    listing, and the cases of a deriving harness, are written to `ours`, where no child
    writes."""
    pair, script = item.pair, harness.script
    folder, ours = folders.children, folders.ours
    stem = item.stem
    added = added_kernels(item)
    listing = ours / f"{stem}.kernels.json"
    listing.write_text(json.dumps(sorted(added)))
    dealt = _dealt_cases(item, harness, device, children, ours)
    if not harness.fixed and not dealt.derived:  # no case at all: nothing to run or compare
        note(f"{shown(pair.name)}: no case of the {script} harness serves its added kernels: "
             "its cubins' loading is proven, not what they compute")
        return OpsProven([], None, [], f"no case of the {script} harness serves this "
                         "file's added kernels", dealt.dead)
    stock_at = children.at(pair.stock)
    cache = None
    if dealt.derives:
        cache = folder / f"{stem}.jit-cache"
        cache.mkdir()
    outs = [(folder / f"{stem}.jit.{n}.pt", folder / f"{stem}.native.{n}.pt")
            for n in range(len(dealt.parts))]
    references = _side(children, script, [
        HarnessCall(stock_at, jit_out, True, part=part, cache=cache)
        for (jit_out, _), part in zip(outs, dealt.parts, strict=True)], [None] * len(outs))
    reference = _joined(references)
    if reference.ended.returncode != 0 and not reference.said.cases:
        raise Sm121Error(f"the {script} harness could not run the stock {pair.name} with "
                         f"--python {children.python}: {reference.failure()}")
    # the first part's cases (a harness may have no fixed case: `_moe_C`'s): the first one
    # that needs an added cubin ends the run
    stock = _harness(children, script, HarnessCall(stock_at, folder / f"{stem}.nojit.pt",
                                                   jit=False, part=dealt.parts[0]))
    stock_failed = stock.ended.returncode != 0 and not stock.ended.timed_out
    without = StockWithoutJit(pair.name, stock_failed, stock.failure() if stock_failed
                              else f"{len(stock.said.cases)} case(s) ran")
    each = [frozenset(f"{c.op}/{c.case}" for c in run.said.cases) for run in references]
    natives = _side(children, script, [
        HarnessCall(pair.runs_as, native_out, False, listing, part)
        for (_, native_out), part in zip(outs, dealt.parts, strict=True)],
        [Asked(cases=keys, kernels=added) for keys in each])
    native = _joined(natives)
    asked = frozenset().union(*each)
    compared: dict[str, Compared] = {}
    unasked = 0
    both = [(jit_out, native_out) for (jit_out, native_out), ref, mine
            in zip(outs, references, natives, strict=True)
            if ref.said.saved is not None and mine.said.saved is not None]
    if both:
        args = [children.at(path) for pair_of in both for path in pair_of]
        _ended, said = children.talk((children.at(COMPARE), *args), "the output comparison",
                                     jit=JIT_ON, asked=Asked(cases=asked))
        compared = {item.key: item for item in said.compared}
        unasked = said.unasked
    modules: dict[str, tuple[int, ...]] = {}
    for cubin in item.cubins:
        if cubin.number in item.paths:
            for kernel in cubin.kernels:
                modules[kernel] = (*modules.get(kernel, ()), cubin.number)
    return OpsProven(_op_results(pair.name, (references, native), compared, unasked, modules),
                     without, native.said.launched, native.said.recorder, dealt.dead)


def _op_results(name: str, runs: tuple[list[HarnessRun], HarnessRun],
                compared: Mapping[str, Compared], unasked: int,
                modules: Mapping[str, tuple[int, ...]]) -> list[OpResult]:
    """Each case the stock JIT run said (its parts'), as the native run and the comparison
    found it, with the added kernels it launched and their cubins (`modules`: added kernel
    -> the numbers of the cubins that define it); and one result that proves nothing when
    the runs' account does not add up (a part that saved other than the cases it said;
    `unasked`: outputs compared that no run said)."""
    parts, native = runs
    reference = _joined(parts)
    native_cases = {(c.op, c.case): c for c in native.said.cases}
    by_case: dict[str, list[KernelLaunched]] = {}
    for one in native.said.launched:
        if one.kernel in modules:
            by_case.setdefault(one.case, []).append(KernelLaunched(one.kernel,
                                                                   modules[one.kernel]))
    results = []
    for case in reference.said.cases:
        mine = native_cases.get((case.op, case.case))
        item = compared.get(f"{case.op}/{case.case}")
        missing = item is not None and item.missing_in and \
            f"output missing in the {item.missing_in} run"
        error = (f"the stock JIT run failed: {case.error}" if case.error else
                 f"the native run failed: {mine.error}" if mine is not None and mine.error else
                 f"the native run ended before it: {native.failure()}" if mine is None else
                 missing or (None if item is not None else
                             f"not compared: the native run failed: {native.failure()}"
                             if native.said.saved is None else "the outputs were not compared"))
        results.append(OpResult(name, case.op, case.case, None if error else item,
                                (case.first_s, mine.first_s if mine else None), error or None,
                                tuple(by_case.get(f"{case.op}/{case.case}", ()))))
    miscounted = [(n, run.said.saved, len({f"{c.op}/{c.case}" for c in run.said.cases}))
                  for n, run in enumerate(parts) if run.said.saved is not None]
    miscounted = [one for one in miscounted if one[1] != one[2]]
    where = f" (part {miscounted[0][0] + 1} of {len(parts)})" \
        if miscounted and len(parts) > 1 else ""
    why = ("no op case was said by the stock JIT run" if not reference.said.cases else
           f"the stock JIT run{where} saved {miscounted[0][1]} output(s) but said "
           f"{miscounted[0][2]} case(s)" if miscounted else
           f"{unasked} output(s) compared that no run said" if unasked else None)
    if why:  # what the runs said does not account for what was compared: nothing proven
        results.append(OpResult(name, "(every op)", "(the runs' account)", None,
                                (None, None), why))
    return results


@dataclass(frozen=True)
class ProveRequest:
    """What is proven, where: the files with their stock files, where the children run,
    what the proof is of, and the GPU the files serve where that is known (an image's
    label)."""

    pairs: tuple[Pair, ...]
    children: Children
    subject: Subject
    serves: Target | None = None
    left_out: tuple[LeftOut, ...] = ()  # files of the subject with no pair, said


def prove_pairs(request: ProveRequest, folder: Path, ours: Path | None = None) -> Proof:
    """The proof of the pairs, the children's files in `folder`: refused in one line before
    any GPU work where it cannot be made."""
    children, subject = request.children, request.subject
    device = probe(children)
    serves = request.serves
    if serves is not None and not cubin_loads(serves.arch, "", device.target):
        raise WrongGpu(f"{shown(str(subject))} serves {serves}; this GPU is {device.target} "
                       f"(compute capability {device.target.major}.{device.target.minor}): "
                       "prove it on the GPU it was made for")
    note(f"GPU {shown(device.name)} ({device.target}); {len(request.pairs)} file(s) with a "
         "stock file")
    # what this process writes (the cubins, their listing) goes to `ours`, a folder the
    # children cannot write: a child could plant a symlink in `folder`, where it writes
    mine = ours or folder
    extracted = extract(list(request.pairs), device.target, mine, subject)
    loads = load_all(children, extracted, mine)
    files, ops, stock_runs = [], [], []
    for item in extracted:
        harness = HARNESSES.get(extension_target(item.pair.name))
        if harness is None:
            note(f"{shown(item.pair.name)}: no harness for its ops: its cubins' loading "
                 "is proven, not what they compute")
            files.append(file_result(item, loads, None, coverage(
                item, [], [], "no harness runs this file's ops")))
            continue
        proven = prove_ops(children, item, harness, Folders(folder, mine), device)
        ops += proven.results
        if proven.without is not None:
            stock_runs.append(proven.without)
        ran = harness.script if proven.without is not None else None  # (no case: none ran)
        files.append(file_result(item, loads, ran, coverage(
            item, proven.launched, proven.results, proven.recorder, proven.dead),
            frozenset(one.kernel for one in proven.launched)))
    kept = {item.pair.name for item in extracted}
    unchanged = [LeftOut(pair.name, "it has no cubin its stock file lacks")
                 for pair in request.pairs if pair.name not in kept]
    made = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Proof(__version__, device, tuple(files), tuple(ops), tuple(stock_runs), made,
                 subject, (*request.left_out, *unchanged))


def run_prove(files: Path, stock: Path, children: Children) -> Proof:
    """`prove --files DIR --stock DIR`: the pairs found there, proven in a temp folder."""
    pairs, left_out = find_pairs(files, stock)
    with tempfile.TemporaryDirectory(prefix="sm121-prove-") as temp:
        return prove_pairs(ProveRequest(tuple(pairs), children,
                                        Subject(files=_utf8_text(files),
                                                stock=_utf8_text(stock)),
                                        left_out=tuple(left_out)),
                           Path(temp))
