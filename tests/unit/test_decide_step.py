"""#61: the main job's decide step (`main_plan.decide_builds`) is a function of what was
gathered (the stock audit, the plans read from the source, the aot actions) and the options
alone: run with every door to the outside blocked (files, folders, the engine's socket and
the network, programs), it decides what it decides with them open."""

from __future__ import annotations

import builtins
import io
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.binary import AotAble, Policy
from sm121_build.cuda.compat import ArchList, parse_target
from sm121_build.cuda.ptxas import Toolchain
from sm121_build.image.facts import ImageFacts, VllmInstall
from sm121_build.jobs.aot_work.aot_step import AotAction
from sm121_build.jobs.formats.render import BuildLayout
from sm121_build.jobs.main_run.main_job import BuildFacts, decide_build
from sm121_build.jobs.main_run.main_plan import (
    BuildChoice,
    ExtensionActions,
    Job,
    Options,
    Resolved,
    Sources,
    decide_builds,
    nothing_to_aot,
)
from sm121_build.rebuild.decide import ExtensionVerdict
from sm121_build.source.git_pin import Checkout, GitRef

# every way out a decision could take: files and folders, sockets, programs
DOORS: tuple[tuple[Any, str], ...] = (
    (builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "lstat"), (os, "scandir"),
    (os, "listdir"), (os, "readlink"), (socket, "socket"), (socket, "create_connection"),
    (subprocess, "Popen"), (os, "posix_spawn"), (os, "fork"), (os, "system"))


@contextmanager
def nothing_outside() -> Iterator[None]:
    """Every door in DOORS raises while the block runs (and only then)."""

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the decide step went outside: {args[:1]!r}")

    with pytest.MonkeyPatch.context() as patch:
        for owner, name in DOORS:
            if hasattr(owner, name):
                patch.setattr(owner, name, refused)
        yield


def _plan(name: str, build: bool, jit: int, reason: str) -> ExtensionVerdict:
    before = {"native": 10, "jit": jit, "none": 0}
    after = {"native": 10 + jit, "jit": 0, "none": 0} if build else before
    return ExtensionVerdict(name, name.split(".")[0], before, after, build, reason,
                         () if build else ("kept: the source gives it nothing",))


STOCK: dict[str, Any] = {"_C.abi3.so": None, "_moe_C.abi3.so": None,
                         "vllm_flash_attn/_vllm_fa2_C.abi3.so": None}
PLANS = (_plan("_C.abi3.so", True, 5, "the guards give sm_121 cubins"),
         _plan("_moe_C.abi3.so", False, 0, "already native"),
         _plan("vllm_flash_attn/_vllm_fa2_C.abi3.so", False, 0, "already native"))
OPTS = Options(base="vllm/vllm-openai:v0.33.0", tag="x:sm121", arch=ArchList.parse("12.1"))


def _decided(opts: Options, plans: tuple[ExtensionVerdict, ...]) -> BuildChoice:
    with nothing_outside():
        blocked = decide_builds(opts, STOCK, plans, ())
    assert decide_builds(opts, STOCK, plans, ()) == blocked  # the same with the doors open
    return blocked


def test_the_blocked_doors_are_shut() -> None:
    """A planted read, listing, connection and program each fail under `nothing_outside`,
    so a decide step that did one would fail the tests below."""
    with nothing_outside():
        for outside in (lambda: Path("/").exists(), lambda: Path("/etc/hostname").read_text(),
                        lambda: os.listdir("/"), lambda: socket.socket(),
                        lambda: subprocess.run(["true"], check=False)):
            with pytest.raises(AssertionError, match="went outside"):
                outside()


def test_the_decision_is_made_of_the_gathered_facts_alone() -> None:
    """What gains is built, what does not is kept (its lines said), --ext adds, --only
    restricts, --force builds _C/_moe_C without the plans; nothing chosen is a result line
    and a decision not to rebuild."""
    choice = _decided(OPTS, PLANS)
    assert choice.chosen == ("_C.abi3.so",) and choice.nothing is None
    assert choice.decision.rebuild and choice.decision.chosen == ("_C.abi3.so",)
    assert choice.decision.reason == "_C: the guards give sm_121 cubins"
    assert choice.decision.extensions["_moe_C.abi3.so"]["action"] == "keep"
    assert choice.lines[0].startswith("_C.abi3.so: build (native 10→15, JIT 5→0")
    assert "  kept: the source gives it nothing" in choice.lines

    added = _decided(replace(OPTS, extra_ext=("auto", "_vllm_fa2_C")), PLANS)
    assert added.chosen == ("_C.abi3.so", "vllm_flash_attn/_vllm_fa2_C.abi3.so")
    only = _decided(replace(OPTS, only=("_moe_C",)), PLANS)
    assert only.chosen == () and only.nothing is not None and not only.decision.rebuild
    forced = _decided(replace(OPTS, force=True), ())
    assert forced.chosen == ("_C.abi3.so", "_moe_C.abi3.so") and forced.lines == ()
    assert forced.decision.reason == "forced (--force)"

    kept = _decided(OPTS, PLANS[1:])
    assert kept.chosen == () and not kept.decision.rebuild
    assert kept.decision.reason == "no extension gains"
    assert kept.nothing is not None and kept.nothing.startswith(
        "no rebuild needed: no extension of vllm/vllm-openai:v0.33.0 gains native")


def test_nothing_to_aot_is_decided_of_the_options_and_the_aot_actions_alone() -> None:
    """`aot IMAGE` (or a GPU with no source rules) with nothing to aot ends at the decide step
    with a decision not to rebuild and its one result line, made with every door shut; a run
    with aot actions, or one that may fall back on the source, goes on (None)."""
    sm90 = Policy(parse_target("sm_90"), (13, 0))
    with nothing_outside():
        image_only = nothing_to_aot(replace(OPTS, aot_only=True), ())
        other_gpu = nothing_to_aot(replace(OPTS, gpu=sm90), ())
        source_left = nothing_to_aot(OPTS, ())
    assert image_only is not None and image_only.decision is not None
    assert image_only.decision.reason == "nothing to aot" and not image_only.decision.rebuild
    assert image_only.line == ("nothing to aot: no extension of vllm/vllm-openai:v0.33.0 has "
                               f"JIT-only kernels with PTX on {OPTS.gpu}; nothing tagged")
    assert other_gpu is not None and f"PTX on {sm90};" in other_gpu.line
    assert source_left is None  # the default GPU has source rules: the source is read next
    some = (AotAction("_C.abi3.so", AotAble(1, 1, 10)),)
    assert nothing_to_aot(replace(OPTS, aot_only=True), some) is None


class _NoPipeline:
    """A pipeline no decision may touch: any attribute read fails the test."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the decide step asked the pipeline for {name}")


def _job(opts: Options) -> Job:
    vllm = VllmInstall("0.19.1", "c" * 40, "/usr/lib/python3/dist-packages", "3.12",
                       ("_C.abi3.so", "_moe_C.abi3.so", "vllm_flash_attn/_vllm_fa2_C.abi3.so"),
                       "/usr/local/cuda/include", "/usr/local/cuda/lib64", "/usr/local/cuda",
                       False, "2.11.0")
    facts = ImageFacts("vllm/vllm-openai:v0.19.1", "sha256:" + "a" * 64,
                       "vllm/vllm-openai@sha256:" + "f" * 64, "linux/arm64", vllm=vllm)
    image = Resolved(facts, vllm, GitRef("commit", "c" * 40), "13.0", ArchList.parse("12.1"))
    return Job(_NoPipeline(), opts, image)  # type: ignore[arg-type]


def test_the_builds_layout_and_key_are_decided_of_the_gathered_facts_alone() -> None:
    """#61: the content key and the layout are decided before anything is carried out, of
    the plan, the options, the base resolved and the gathered facts (`BuildFacts`), with
    every door shut and no pipeline: a source build with aot'd files in it, and aot alone;
    every gathered fact the key is made of changes it."""
    toolchain = Toolchain(Path("/nowhere/bin"), (13, 0), "13.0.88")
    aot = (AotAction("vllm_flash_attn/_vllm_fa2_C.abi3.so", AotAble(1, 1, 10)),)
    checkout = Checkout(Path("/nowhere/src"), "c" * 40, "", "")
    sources = Sources("c" * 40, ("c" * 40, "flash-attention@" + "f" * 40 + "+"),
                      (("VLLM_FLASH_ATTN_SRC_DIR", "flash-attention"),), Path("/nowhere/src"))
    both = ExtensionActions(aot, ("_C.abi3.so",), checkout, toolchain)
    facts = BuildFacts(sources, frozenset({"_C", "_moe_C"}), True, 8, "rules", "templates")
    job = _job(OPTS)
    with nothing_outside():
        built = decide_build(job, both, facts)
        alone = decide_build(job, ExtensionActions(aot, (), None, toolchain),
                             BuildFacts(None, None, False, 8, "", ""))
        others = {decide_build(job, both, replace(facts, **change)).key for change in (
            {"rules": "other rules"}, {"templates": "other templates"},
            {"sources": replace(sources, provenance=("d" * 40,))})}
    assert isinstance(built.layout, BuildLayout) and built.layout.extensions == ("_C.abi3.so",)
    assert built.layout.prebuilt == ("vllm_flash_attn/_vllm_fa2_C.abi3.so",)
    assert built.layout.jobs == 8 and built.layout.buildkit
    assert built.patches == "rules+aot-ptxas-13.0.88" and built.sources == sources
    assert built == decide_build(job, both, facts)  # the same with the doors open
    assert not isinstance(alone.layout, BuildLayout) and alone.patches == "aot-ptxas-13.0.88"
    assert alone.layout.extensions == ("vllm_flash_attn/_vllm_fa2_C.abi3.so",)
    assert alone.sources == Sources("c" * 40, ("c" * 40,))
    assert built.key not in others and len(others) == 3 and alone.key != built.key
    with pytest.raises(Sm121Error, match="no CMake target for _moe_C"):
        decide_build(job, replace(both, build=("_C.abi3.so", "_moe_C.abi3.so")),
                     replace(facts, targets=frozenset({"_C"})))
