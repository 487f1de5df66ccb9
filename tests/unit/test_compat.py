"""CUDA's loading rules, table-driven."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.compat import (
    ArchList,
    best,
    dotted_arch,
    entry_verdict,
    max_ptx_isa,
    parse_cuda_version,
    parse_target,
    ptx_isa_table,
)

DEFAULT_TARGET = parse_target("sm_121")


@dataclass(frozen=True)
class EntryCode:
    """An entry's code alone (a fatbin `Entry`'s kind, arch, variant and version)."""

    kind: str
    arch: int
    variant: str
    version: tuple[int, int]
CUDA13 = (13, 0)


@pytest.mark.parametrize(("kind", "arch", "variant", "expected"), [
    ("elf", 121, "", "native"),
    ("elf", 121, "a", "native"),
    ("elf", 120, "", "native"),     # same major, lower minor
    ("elf", 120, "f", "native"),     # family
    ("elf", 120, "a", "none"),       # arch-specific: exact arch only
    ("elf", 100, "", "none"),        # other major
    ("elf", 100, "f", "none"),
    ("elf", 90, "a", "none"),
    ("elf", 90, "", "none"),         # cubins never cross majors
    ("elf", 122, "", "none"),        # newer minor
    ("ptx", 90, "", "jit"),          # plain PTX JITs forward
    ("ptx", 120, "", "jit"),
    ("ptx", 121, "", "jit"),
    ("ptx", 120, "f", "jit"),
    ("ptx", 100, "f", "none"),       # family PTX stays in its family
    ("ptx", 90, "a", "none"),        # arch-specific PTX too
    ("ptx", 121, "a", "jit"),
    ("ptx", 122, "", "none"),
    ("ptx", 120, "a", "none"),       # arch-specific PTX of a lower minor: exact arch only
    ("elf", 122, "f", "none"),       # a family cubin of a newer minor does not load
    ("ptx", 122, "f", "none"),       # nor does its PTX
    ("elf", 121, "f", "native"),
    ("ptx", 121, "f", "jit"),
])
def test_sm121_rules(kind: str, arch: int, variant: str, expected: str) -> None:
    assert entry_verdict(EntryCode(kind, arch, variant, (9, 0)), DEFAULT_TARGET, CUDA13) == expected


def test_ptx_newer_than_driver_cannot_jit() -> None:
    assert entry_verdict(EntryCode("ptx", 90, "", (8, 8)), DEFAULT_TARGET, (12, 9)) == "jit"
    assert entry_verdict(EntryCode("ptx", 90, "", (9, 0)), DEFAULT_TARGET, (12, 9)) == "none"
    assert entry_verdict(EntryCode("ptx", 90, "", (9, 0)), DEFAULT_TARGET, CUDA13) == "jit"


def testptx_isa_table() -> None:
    assert max_ptx_isa((13, 0)) == (9, 0)
    assert max_ptx_isa((12, 7)) == (8, 5)  # no 12.7 release: the floor entry
    assert max_ptx_isa((99, 0)) is None     # newer than we know: no limit applied


@pytest.mark.parametrize("text", ["sm_121", "121", "12.1", "SM_121", "sm_121a", "compute_121"])
def test_parse_target(text: str) -> None:
    assert parse_target(text).arch == 121


@pytest.mark.parametrize("text", ["sm121x", "", "12", "gb10"])
def test_parse_target_rejects(text: str) -> None:
    with pytest.raises(Sm121Error, match="unknown GPU target"):
        parse_target(text)


def test_the_reverse_cases_on_sm120() -> None:
    """Code for sm_121 on an sm_120 GPU: newer minors never load, in any form."""
    sm120 = parse_target("sm_120")
    for kind, variant in (("elf", ""), ("elf", "a"), ("elf", "f"), ("ptx", ""), ("ptx", "a"),
                          ("ptx", "f")):
        assert entry_verdict(EntryCode(kind, 121, variant, (9, 0)), sm120, CUDA13) == "none", (kind,
                                                                                     variant)
    assert entry_verdict(EntryCode("elf", 120, "f", (9, 0)), sm120, CUDA13) == "native"


def test_other_targets() -> None:
    sm90 = parse_target("sm_90")
    assert entry_verdict(EntryCode("elf", 90, "a", (1, 8)), sm90, CUDA13) == "native"
    assert entry_verdict(EntryCode("elf", 80, "", (1, 8)), sm90, CUDA13) == "none"
    assert entry_verdict(EntryCode("ptx", 80, "", (8, 0)), sm90, CUDA13) == "jit"
    sm103 = parse_target("10.3")
    assert entry_verdict(EntryCode("elf", 100, "f", (1, 8)), sm103, CUDA13) == "native"
    assert entry_verdict(EntryCode("elf", 100, "a", (1, 8)), sm103, CUDA13) == "none"


def test_driver_version_parse() -> None:
    assert parse_cuda_version("13.0") == (13, 0)
    with pytest.raises(Sm121Error):
        parse_cuda_version("thirteen")


def test_targets_come_from_the_one_table() -> None:
    """The GPUs a value may name are `KNOWN_ARCHS` (the arch lists' table): sm_50 is the
    oldest; one no CUDA toolkit knows is refused here, never by ptxas once per module."""
    assert parse_target("sm_50").arch == 50 and parse_target("11.0").arch == 110
    for text in ("sm_30", "sm_29", "sm_20", "2.9", "sm_999", "sm_122", "12.9", "99.9"):
        with pytest.raises(Sm121Error, match="unknown GPU target"):
            parse_target(text)


def test_dotted_arch() -> None:
    assert dotted_arch("12.0f") == (120, "f")
    assert dotted_arch("9.0") == (90, "")
    assert dotted_arch("12.1+PTX") is None and dotted_arch("sm_121") is None
    # non-zero minors: 12.1 is 121 (a '-' for '+' in the arch sum would give 119)
    assert dotted_arch("12.1") == (121, "")
    assert dotted_arch("12.1a") == (121, "a")
    assert dotted_arch("10.3f") == (103, "f")
    assert dotted_arch("8.9") == (89, "")


def test_the_newest_known_driver_and_an_older_one() -> None:
    table = ptx_isa_table()
    newest = max(table)
    assert max_ptx_isa(newest) == table[newest]
    assert max_ptx_isa((newest[0], newest[1] + 1)) is None
    with pytest.raises(Sm121Error, match=r"^CUDA driver 10\.2 is older than CUDA 11\.0$"):
        max_ptx_isa((10, 2))


def test_unknown_entry_kinds_and_the_best_verdict() -> None:
    assert entry_verdict(EntryCode("nvvm", 121, "", (9, 0)), DEFAULT_TARGET, CUDA13) == "none"
    assert best(["jit", "native", "none"]) == "native"
    assert best(["none", "jit"]) == "jit"
    assert best(["none"]) == "none" and best([]) == "none"


def test_an_arch_list_has_one_type_with_its_torch_and_cmake_forms() -> None:
    archs = ArchList.parse("8.0+PTX 12.1a")
    assert (archs.torch, archs.cmake, archs.items) == ("8.0+PTX;12.1a", "8.0;12.1a",
                                                       ("8.0+PTX", "12.1a"))
    assert str(archs) == "8.0+PTX;12.1a" and ArchList.parse("12.0;12.1").cmake == "12.0;12.1"
    assert ArchList.parse("12.0f, 12.1") == ArchList.parse("12.0f;12.1")  # one spelling
    assert ArchList.parse("12.0f 12.1").tag == "sm120f-sm121"
    with pytest.raises(Sm121Error, match="unknown arch 'sm_121'"):
        ArchList.parse("sm_121")
