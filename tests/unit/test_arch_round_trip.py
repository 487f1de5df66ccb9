"""Every arch list the command line accepts round-trips through what the tool writes: the
spelling `--arch` gives the run (`cli/params.arch_list`), the artifacts manifest's check,
CMake's list and the kernels image's pinned tag.  The bug this pins: `--arch 12.0f,12.1`
built, and then `inject --artifacts` refused the manifest the run wrote (a `,` the
manifest's check did not know), and the lookup tag differed from the published one."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sm121_build.cli.params import arch_list
from sm121_build.cuda.compat import KNOWN_ARCHS, ArchList
from sm121_build.jobs.formats import artifacts
from sm121_build.jobs.kernel_images.kernels_image import pinned_tag

_ENTRY = st.builds(lambda arch, variant, ptx: f"{arch}{variant}{ptx}",
                   st.sampled_from(sorted(KNOWN_ARCHS)), st.sampled_from(["", "a", "f"]),
                   st.sampled_from(["", "+PTX"]))
_LISTS = st.tuples(st.lists(_ENTRY, min_size=0, max_size=4),
                   st.sampled_from(["12.1", "12.1a", "12.0f"]),
                   st.sampled_from([";", " ", ",", ", ", " ; "]))


@settings(max_examples=300, deadline=None)
@given(_LISTS)
def test_an_accepted_arch_list_is_read_back_the_same_everywhere(
        case: tuple[list[str], str, str]) -> None:
    entries, native, separator = case
    written = separator.join([*entries, native])
    try:
        parsed = arch_list(None, None, written)
    except click.BadParameter:
        return  # refused at the edge (an arch and variant CUDA has not): nothing is written
    spelt = str(parsed)  # what the manifest, the labels and the record carry
    assert artifacts._is_arch_list(spelt), spelt  # the manifest check takes it
    assert ArchList.parse(spelt) == parsed  # read back from any of them: the same value
    assert parsed.cmake == ";".join(e.replace("+PTX", "") for e in [*entries, native])
    assert pinned_tag("0.33.0", "c" * 40, ArchList.parse(spelt)) == pinned_tag(
        "0.33.0", "c" * 40, parsed)
    assert arch_list(None, None, spelt) == parsed  # once spelt, it stays so


@pytest.mark.parametrize("written", ["12.0f,12.1", "9.0 12.1a", "12.1;8.0+PTX"])
def test_the_manifest_a_run_writes_for_it_is_loaded(tmp_path: Path, written: str) -> None:
    (tmp_path / "_C.abi3.so").write_bytes(b"\x7fELF" + b"\0" * 60)
    manifest = {"vllm_version": "0.33.0", "vllm_commit": "c" * 40,
                "arch_list": str(arch_list(None, None, written)), "files": {
                    "_C.abi3.so": {"sha256": __import__("hashlib").sha256(
                        b"\x7fELF" + b"\0" * 60).hexdigest()}}}
    (tmp_path / artifacts.MANIFEST).write_text(json.dumps(manifest))
    try:
        found = artifacts.load(tmp_path)
    except Exception as exc:  # the arch list must not be what refuses it
        assert "arch_list" not in str(exc), exc
        return
    assert found.provenance.arch_list == manifest["arch_list"]
