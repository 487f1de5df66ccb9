"""guards.py piece by piece: finding the guard calls (the CMake reader's output, variables,
wrappers, branches), the `cmake -P` driver with real cmake, and the small helpers.

The end-to-end shapes (rules on nightlies' CMake) are in test_guard_rules.py; here every
branch of the evaluation has a test that names what it pins, so a one-line bug fails one.
Guard functions are the fixture's (tests/data/vllm_like/cmake/utils.cmake) or written here.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from devkit.helpers import vllm_like_tree as _tree
from sm121_build.core.errors import Sm121Error
from sm121_build.cuda.compat import ArchList
from sm121_build.source import guards
from sm121_build.source.cmake_lang import commands
from sm121_build.source.guards import (
    Call,
    Guard,
    _branches,
    _collect,
    _Definitions,
    _known,
    _literal,
    _quote,
    _run,
    cmake_error,
    effective_archs,
    evaluate,
    find_calls,
    find_cmake,
    intersect,
    parse,
    scan_files,
    supported_archs_block,
)

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

GE13 = "${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0"
# Guard functions for the driver tests, beside the fixture's cuda_archs_loose_intersection.
ECHO = """
function(sm121_echo OUT VALUE)
  set(${OUT} "${VALUE}" PARENT_SCOPE)
endfunction()
function(sm121_nothing OUT)
endfunction()
function(sm121_stray)
  file(WRITE "stray.txt" "x")
endfunction()
"""


def _call(tmp_path: Path, cmakelists: str, utils_extra: str = "") -> Call:
    (call,) = find_calls(_tree(tmp_path, cmakelists, utils_extra))
    return call


def _guard(targets: tuple[str, ...] | None, function: str = guards.GUARD_FUNCTION,
           arch_list: str | None = "12.0f") -> Guard:
    call = Call("cmake/x.cmake", 7, function, "FP4_ARCHS", arch_list, None, None, "", (), "",
                True)
    return Guard(call, targets)


# --- small helpers ---------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "expected"), [
    ("12.1", "12.1"), ("12.1a", "12.1a"), ("12.0f", "12.0f"), ("9.0 12.1a", "9.0;12.1a"),
    ("8.0+PTX;12.1", "8.0;12.1"), (" 10.0,12.1 ", "10.0;12.1"),
])
def test_cmake_arch_list(given: str, expected: str) -> None:
    assert ArchList.parse(given).cmake == expected


@pytest.mark.parametrize("bad", ["12", "sm_121", "121.1", "12.1b", "12.10", "12.1+ptx", "1.2.3"])
def test_cmake_arch_list_refuses(bad: str) -> None:
    with pytest.raises(Sm121Error) as error:
        ArchList.parse(f"9.0 {bad}")
    assert str(error.value) == (f"unknown arch {bad!r} in '9.0 {bad}': expected e.g. 12.1 or "
                                "12.1a")


def test_guard_properties() -> None:
    guard = _guard(("12.0", "12.0a", "12.1f", "9.0", "12.12", "112.0"))
    assert guard.plain_sm12x == ("12.0", "12.12")
    assert guard.location == "cmake/x.cmake:7"
    assert (guard.file, guard.line, guard.variable, guard.arch_list, guard.branch) == (
        "cmake/x.cmake", 7, "FP4_ARCHS", "12.0f", "")
    assert guard.taken
    unknown = _guard(None, function="cuda_archs_sm100", arch_list=None)
    assert (unknown.targets, unknown.plain_sm12x) == ((), ())
    assert unknown.arch_list == "(in cuda_archs_sm100)"


def test_quote_escapes_backslashes_then_quotes() -> None:
    assert _quote('a"b\\c') == '"a\\"b\\\\c"'
    assert _quote("") == '""'


# --- finding cmake (fake cmake executables: only their --version output matters) -------------

def _fake_cmake(folder: Path, name: str, output: str, code: int = 0) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    log = folder / f"{name}.calls"
    path.write_text(f"#!/bin/sh\necho called >> '{log}'\necho '{output}'\nexit {code}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_find_cmake_takes_the_first_new_enough(tmp_path: Path,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    old = _fake_cmake(tmp_path, "old", "cmake version 3.25.9")
    failing = _fake_cmake(tmp_path, "failing", "cmake version 3.30.0", code=1)
    garbled = _fake_cmake(tmp_path, "garbled", "cmake 3.30.0")
    minimum = _fake_cmake(tmp_path, "minimum", "cmake version 3.26.0")
    later = _fake_cmake(tmp_path, "later", "cmake version 4.0.1")
    candidates = (str(tmp_path / "absent"), old, failing, garbled, minimum, later)
    assert find_cmake(candidates) == minimum
    assert find_cmake((str(tmp_path / "absent"), later, minimum)) == later
    assert find_cmake((old, _fake_cmake(tmp_path, "major", "cmake version 4.0"))).endswith(
        "major")
    assert capfd.readouterr().out == ""  # the --version output is read, not shown
    # found once per process: asking again runs nothing
    find_cmake(candidates)
    assert (tmp_path / "minimum.calls").read_text() == "called\n"


def test_find_cmake_without_a_new_enough_one_is_one_error(tmp_path: Path) -> None:
    old = _fake_cmake(tmp_path, "old", "cmake version 3.20.0")
    with pytest.raises(Sm121Error) as error:
        find_cmake((old, str(tmp_path / "absent")))
    assert str(error.value) == "cmake >= 3.26 not found: `pip install cmake` (vLLM needs it)"


def test_find_cmake_prefers_the_package_binary_to_its_launcher() -> None:
    import cmake as cmake_package
    binary = str(Path(cmake_package.CMAKE_BIN_DIR) / "cmake")
    launcher = str(Path(sys.executable).parent / "cmake")
    assert guards.cmake_candidates() == [binary, launcher, "cmake"]
    assert find_cmake() == binary
    with open(binary, "rb") as handle:
        assert handle.read(4) == b"\x7fELF"  # no Python start-up on every evaluation


# --- reading the files --------------------------------------------------------------------------

def test_scan_files_relative_sorted_once_files_only(tmp_path: Path) -> None:
    source = _tree(tmp_path, "", b="", a="", **{"external/z": "", "external/y": ""})
    (source / "cmake" / "dir.cmake").mkdir()
    (source / "csrc").mkdir()
    (source / "csrc" / "x.cmake").write_text("")
    assert scan_files(source) == ["CMakeLists.txt", "cmake/a.cmake", "cmake/b.cmake",
                                  "cmake/external/y.cmake", "cmake/external/z.cmake",
                                  "cmake/utils.cmake"]
    assert scan_files(source, ("cmake/external/*.cmake", "cmake/**/*.cmake")) == [
        "cmake/external/y.cmake", "cmake/external/z.cmake", "cmake/a.cmake", "cmake/b.cmake",
        "cmake/utils.cmake"]


def test_parse_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad.cmake").write_text('set(X "unterminated)\n')
    with pytest.raises(Sm121Error, match=r"^cmake/bad\.cmake: cannot read it as CMake: "):
        parse(tmp_path / "bad.cmake", "cmake/bad.cmake")
    (tmp_path / "latin.cmake").write_bytes(b"set(X \xff)\n")  # CMake reads it: so do we
    text, cmds = parse(tmp_path / "latin.cmake", "l.cmake")
    assert [c.name for c in cmds] == ["set"] and text.encode(errors="surrogateescape") == \
        b"set(X \xff)\n"
    with pytest.raises(Sm121Error, match=r"^gone\.cmake: cannot read it: .*No such file"):
        parse(tmp_path / "gone.cmake", "gone.cmake")
    good = tmp_path / "good.cmake"
    good.write_text("set(X 1)\n")
    text, cmds = parse(good, "good.cmake")
    assert text == "set(X 1)\n" and [c.name for c in cmds] == ["set"]


# --- variables and wrappers ---------------------------------------------------------------------

def test_literal_joins_plain_arguments_only() -> None:
    (cmd,) = commands('x(a "b c" [[d]])')
    assert _literal(cmd.arguments) == "a;b c;d"
    assert _literal(()) == ""
    assert _literal(commands("x(a ${B})")[0].arguments) is None
    assert _literal(commands('x("a${B}c")')[0].arguments) is None
    assert _literal(commands("x(a (b))")[0].arguments) is None


def test_definitions_value_and_possible() -> None:
    defs = _Definitions(
        sets={"ONCE": ["12.0f;9.0"], "TWICE": ["1", "2"], "EXT": ["9.0"], "MOD": ["1"],
              "OPAQUE": [None], "EMPTY": [""]},
        extra={"EXT": ["12.1", ""], "ONLYEXT": ["8.0;;7.5"]}, modified={"MOD"})
    assert defs.value("ONCE") == "12.0f;9.0"
    assert [defs.value(n) for n in ("TWICE", "EXT", "MOD", "OPAQUE", "UNSET")] == [
        None, None, None, None, None]
    assert defs.value("EMPTY") == ""
    assert defs.possible("ONCE") == ["12.0f", "9.0"]
    assert defs.possible("TWICE") == ["1", "2"]
    assert defs.possible("EXT") == ["9.0", "12.1"]
    assert defs.possible("ONLYEXT") == ["8.0", "7.5"]
    assert defs.possible("EMPTY") == []
    assert [defs.possible(n) for n in ("MOD", "OPAQUE", "UNSET")] == [None, None, None]


def _collected(**files: str) -> tuple[_Definitions, dict[str, str]]:
    return _collect({rel: commands(text) for rel, text in files.items()})


def test_collect_sets_lists_and_scopes() -> None:
    defs, _ = _collected(CMakeLists=(
        'set(A "12.0f;10.0f")\nset(B ${A})\nset(C "x" PARENT_SCOPE)\n'
        'set(D "1" CACHE STRING "doc")\nset(E 9.0 12.0a)\nset()\nSET(U 1)\n'
        'list(APPEND E "12.1")\nLIST(prepend F "8.0" 8.6)\nlist(INSERT G 0 "7.5")\n'
        "list(APPEND)\nlist(LENGTH A n)\nlist(GET A 0 first)\nlist(FIND A x at)\n"))
    assert defs.sets == {"A": ["12.0f;10.0f"], "B": [None], "C": [None], "D": [None],
                         "E": ["9.0;12.0a"], "U": ["1"]}
    assert defs.extra == {"E": ["12.1"], "F": ["8.0;8.6"], "G": ["7.5"]}
    assert defs.modified == set()


@pytest.mark.parametrize("op", ["REMOVE_ITEM", "remove_at", "FILTER", "TRANSFORM",
                                "REMOVE_DUPLICATES", "POP_BACK", "POP_FRONT", "SORT", "REVERSE"])
def test_collect_other_list_operations_make_a_variable_unknown(op: str) -> None:
    defs, _ = _collected(x=f'set(A "12.0f")\nlist({op} A x)\n')
    assert defs.modified == {"A"} and defs.value("A") is None and defs.possible("A") is None


def test_collect_skips_function_bodies_and_finds_wrappers_through_each_other() -> None:
    utils = (
        "macro(outer OUT)\n  set(INSIDE 1)\n  middle(${OUT})\nendmacro()\n"
        'Function(Middle OUT)\n  cuda_archs_loose_intersection(${OUT} "12.0f" "${CUDA_ARCHS}")\n'
        "endfunction()\n"
        "function(unrelated OUT)\n  set(${OUT} 1)\nendfunction()\n"
        "function(calls_unrelated)\n  unrelated(X)\nendfunction()\n"
        "set(AFTER 1)\nmacro(m)\n  set(IN_MACRO 1)\nendmacro()\nset(AFTER_MACRO 1)\n")
    defs, functions = _collected(**{"cmake/utils.cmake": utils,
                                    "CMakeLists.txt": "function(late OUT)\n  outer(${OUT})\n"
                                                      "endfunction()\n"})
    assert functions == {"cuda_archs_loose_intersection": "", "middle": "cmake/utils.cmake",
                         "outer": "cmake/utils.cmake", "late": "CMakeLists.txt"}
    assert defs.sets == {"AFTER": ["1"], "AFTER_MACRO": ["1"]}


# --- branches ----------------------------------------------------------------------------------

def test_known_conditions_test_only_the_cuda_version() -> None:
    def known(condition: str) -> str | None:
        return _known(commands(f"if({condition})")[0])

    assert known(GE13) == GE13
    assert known("CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8") == \
        "CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8"
    assert known("DEFINED CMAKE_CUDA_COMPILER_VERSION AND NOT (${CMAKE_CUDA_COMPILER_VERSION} "
                 "VERSION_GREATER 12.9.1 OR ${CMAKE_CUDA_COMPILER_VERSION} VERSION_EQUAL "
                 "12.0)") == ("DEFINED CMAKE_CUDA_COMPILER_VERSION AND NOT ( "
                              "${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER 12.9.1 OR "
                              "${CMAKE_CUDA_COMPILER_VERSION} VERSION_EQUAL 12.0 )")
    for word in ("VERSION_LESS_EQUAL", "VERSION_GREATER_EQUAL"):
        assert known(f"CMAKE_CUDA_COMPILER_VERSION {word} 12") is not None
    assert known(f"{GE13} AND WITH_FP4") is None
    assert known("13.0 VERSION_LESS 12.8") is None
    assert known("x${CMAKE_CUDA_COMPILER_VERSION} VERSION_LESS 12.8") is None
    assert known("${CMAKE_CUDA_COMPILER_VERSION}x VERSION_LESS 12.8") is None
    assert known("CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8a") is None
    assert known("CMAKE_CUDA_COMPILER_VERSION STREQUAL 12.8") is None
    assert known("") is None


def test_branches_as_shown_and_as_replayed() -> None:
    text = (f"if({GE13})\n  a()\nelseif(WITH_X)\n  b()\n"
            "elseif(CMAKE_CUDA_COMPILER_VERSION   VERSION_LESS\n    12.8)\n  c()\n"
            "  if(NESTED)\n    n()\n  endif()\nelse()\n  d()\nendif()\ne()\n"
            "endif()\nelse()\nelseif(Y)\nf()\nif()\ng()\nendif()\n")
    cmds = commands(text)
    got = {c.name: branch[:2] for c, branch in zip(cmds, _branches(cmds, text), strict=True)
           if c.key not in ("if", "elseif", "else", "endif")}
    decided = {c.name: branch[2] for c, branch in zip(cmds, _branches(cmds, text), strict=True)
               if c.key not in ("if", "elseif", "else", "endif")}
    # only a() and the commands outside any if() sit under conditions CMake -P decides
    assert decided == {"a": True, "b": False, "c": False, "n": False, "d": False, "e": True,
                       "f": True, "g": False}
    lt128 = "CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8"
    assert got == {
        "a": (GE13, (((), GE13),)),
        "b": ("elseif WITH_X", (((GE13,), "TRUE"),)),
        "c": (f"elseif {lt128}", (((GE13,), lt128),)),
        "n": ("NESTED", (((GE13,), lt128), ((), "TRUE"))),
        "d": (f"else of elseif {lt128}", (((GE13, lt128), "TRUE"),)),
        "e": ("", ()),
        "f": ("", ()),  # stray endif/else/elseif change nothing
        "g": ("", (((), "TRUE"),)),
    }
    shown = [b for c, (b, _, _k) in zip(cmds, _branches(cmds, text), strict=True)
             if c.key == "if"]
    assert shown[:2] == [GE13, "NESTED"]


def test_an_else_after_an_unknown_elseif_keeps_the_known_priors() -> None:
    text = f"if(A)\nelseif({GE13})\nelseif(B)\nelse()\n  x()\nendif()\n"
    cmds = commands(text)
    assert _branches(cmds, text)[4] == ("else of elseif B", (((GE13,), "TRUE"),), False)


# --- the calls -----------------------------------------------------------------------------------

def test_a_literal_call_as_found(tmp_path: Path) -> None:
    call = _call(tmp_path, f'\nif({GE13})\n  cuda_archs_loose_intersection(FP4_ARCHS '
                           f'"12.0f;10.0a" "${{CUDA_ARCHS}}")\nendif()\n')
    assert call.file == "CMakeLists.txt" and call.line == 3
    assert (call.function, call.variable, call.arch_list) == (
        "cuda_archs_loose_intersection", "FP4_ARCHS", "12.0f;10.0a")
    assert call.list_arg is not None and call.list_arg.value == "12.0f;10.0a"
    assert call.evaluated_args == ("12.0f;10.0a", "${CUDA_ARCHS}")
    assert (call.branch, call.levels, call.unresolved, call.may_give_sm12x) == (
        GE13, (((), GE13),), "", True)


def test_a_list_from_variables_is_expanded(tmp_path: Path) -> None:
    call = _call(tmp_path, 'set(FP4 "12.0f")\nset(OLD 9.0)\n'
                           'cuda_archs_loose_intersection(X "${FP4};${OLD};8.0" "${CUDA_ARCHS}")\n')
    assert call.arch_list == "12.0f;9.0;8.0"
    assert call.list_arg is not None and call.list_arg.value == "${FP4};${OLD};8.0"
    assert call.evaluated_args == ("12.0f;9.0;8.0", "${CUDA_ARCHS}")
    assert call.may_give_sm12x


@pytest.mark.parametrize(("lists", "may"), [
    ('set(L "9.0")\nlist(SORT L)\n', True),
    ('set(L "${OTHER}")\n', True),
    ('set(L "9.0")\nif(WANT)\n  list(APPEND L "10.0")\nendif()\n', False),
    ('set(L "9.0")\nif(WANT)\n  list(APPEND L "12.0a")\nendif()\n', True),
])
def test_an_unresolvable_list_may_or_may_not_hold_12x(tmp_path: Path, lists: str,
                                                       may: bool) -> None:
    call = _call(tmp_path, lists + 'cuda_archs_loose_intersection(X "${L};8.0" "${CUDA_ARCHS}")\n')
    assert call.evaluated_args is None
    assert call.unresolved == "${L} is not set once to a literal list in the scanned files"
    assert call.arch_list == "${L};8.0"
    assert call.may_give_sm12x is may


@pytest.mark.parametrize(("lists", "may", "gives"), [
    ('set(L "9.0")\nlist(APPEND L "10.0")\n', False, ("8.0", "9.0", "10.0")),
    ('set(L "9.0")\nlist(APPEND L "12.0a")\n', True, ("8.0", "9.0", "12.0a")),
    ('set(L "9.0")\nset(L "12.0")\n', True, ("8.0", "12.0")),
    ('set(L "9.0")\nset(L "10.0")\n', False, ("8.0", "10.0")),
    # 0.33.0's deepgemm.cmake: appended per CUDA version, the branch replayed by CMake
    ('set(L)\nif(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0)\n'
     '  list(APPEND L "12.0f")\nelse()\n  list(APPEND L "12.0a" "12.1a")\nendif()\n',
     True, ("8.0", "12.0")),
])
def test_a_list_built_by_literal_steps_is_replayed(tmp_path: Path, lists: str, may: bool,
                                                   gives: tuple[str, ...]) -> None:
    text = lists + 'cuda_archs_loose_intersection(X "${L};8.0" "${CUDA_ARCHS}")\n'
    source = _tree(tmp_path, text)
    (call,) = find_calls(source)
    assert call.unresolved == "" and call.evaluated_args == ("${L};8.0", "${CUDA_ARCHS}")
    assert call.prelude and all(step[0].startswith(("set(L", "list(APPEND L"))
                                for step in call.prelude)
    assert call.may_give_sm12x is may
    (guard,) = evaluate(source, ArchList.parse("8.0;9.0;10.0;12.0"), "13.0")
    assert guard.result is not None and set(guard.result) == set(gives)
    if "else()" in lists:  # the other branch under CUDA 12.9: 12.0a, not the family entry
        (older,) = evaluate(source, ArchList.parse("8.0;9.0;10.0;12.0"), "12.9")
        assert older.result is not None and set(older.result) == {"8.0", "12.0a"}


def test_a_step_after_the_call_or_in_another_file_is_not_replayed(tmp_path: Path) -> None:
    call = _call(tmp_path, 'set(L "9.0")\ncuda_archs_loose_intersection(X "${L}" '
                           '"${CUDA_ARCHS}")\nlist(APPEND L "12.0")\n')
    assert call.evaluated_args is None and call.may_give_sm12x


@pytest.mark.parametrize(("written", "may"), [
    ('set(L "9.0")\nlist(SORT L)\n', True), ('set(L "10.0")\nlist(SORT L)\n', True)])
def test_the_target_list_inside_a_list_is_skipped_not_the_rest(tmp_path: Path, written: str,
                                                                 may: bool) -> None:
    call = _call(tmp_path, written + 'cuda_archs_loose_intersection(X "${CUDA_ARCHS};${L}" '
                                     '"${CUDA_ARCHS}")\n')
    assert call.unresolved == "${L} is not set once to a literal list in the scanned files"
    assert call.may_give_sm12x is may


def test_a_variable_set_empty_expands_to_nothing(tmp_path: Path) -> None:
    call = _call(tmp_path, 'set(E "")\ncuda_archs_loose_intersection(X "${E}" "${CUDA_ARCHS}")\n')
    assert (call.unresolved, call.evaluated_args, call.arch_list) == (
        "", ("", "${CUDA_ARCHS}"), "")
    assert not call.may_give_sm12x


def test_a_12x_entry_with_a_variable_suffix_may_give_12x(tmp_path: Path) -> None:
    call = _call(tmp_path, 'set(S "a")\nif(ANY)\n  set(S "f")\nendif()\n'
                           'cuda_archs_loose_intersection(X "9.0;12.0${S}" "${CUDA_ARCHS}")\n')
    assert call.evaluated_args is None and call.may_give_sm12x


def test_a_literal_12x_entry_beside_an_unknown_variable_may_give_12x(tmp_path: Path) -> None:
    call = _call(tmp_path, 'cuda_archs_loose_intersection(X "${UNSET};12.0a" "${CUDA_ARCHS}")\n')
    assert call.may_give_sm12x and call.evaluated_args is None
    call = _call(tmp_path / "b", 'cuda_archs_loose_intersection(X "9.0;112.0" "${CUDA_ARCHS}")\n')
    assert not call.may_give_sm12x and call.evaluated_args == ("9.0;112.0", "${CUDA_ARCHS}")


@pytest.mark.parametrize(("written", "why"), [
    ('cuda_archs_loose_intersection(${OUT} "12.0f" "${CUDA_ARCHS}")',
     "its output variable '${OUT}' is not a plain name"),
    ('cuda_archs_loose_intersection(X "12.0f")', "expected 3 arguments, found 2"),
    ('cuda_archs_loose_intersection(X "12.0f" "${CUDA_ARCHS}" extra)',
     "expected 3 arguments, found 4"),
    ('cuda_archs_loose_intersection(X "${UNSET}" "${CUDA_ARCHS}")',
     "${UNSET} is not set once to a literal list in the scanned files"),
    ('cuda_archs_loose_intersection(X ${LIST} "${CUDA_ARCHS}")',
     "its argument ${LIST} is unquoted: CMake splits it"),
    ('cuda_archs_loose_intersection(X 12.0f;9.0 "${CUDA_ARCHS}")',
     "its argument 12.0f;9.0 is unquoted: CMake splits it"),
    ('cuda_archs_loose_intersection(X "12.0f" ${CUDA_ARCHS})',
     "its argument ${CUDA_ARCHS} is unquoted: CMake splits it"),
    ('cuda_archs_loose_intersection(X "12.0f" "8.0")',
     'its target list is not "${CUDA_ARCHS}"'),
    ('cuda_archs_loose_intersection(X "${CUDA_ARCHS}" "12.0f")',
     'its target list is not "${CUDA_ARCHS}"'),
    ('cuda_archs_loose_intersection(${OUT} "12.0f")',
     "its output variable '${OUT}' is not a plain name"),
    ('cuda_archs_loose_intersection(X "${UNSET}" ${LIST})',
     "${UNSET} is not set once to a literal list in the scanned files"),
    ('cuda_archs_loose_intersection(X ${LIST} "8.0")',
     "its argument ${LIST} is unquoted: CMake splits it"),
])
def test_why_a_call_cannot_be_evaluated(tmp_path: Path, written: str, why: str) -> None:
    call = _call(tmp_path, f'set(LIST "12.0f")\n{written}\n')
    assert (call.unresolved, call.evaluated_args) == (why, None)


def test_unquoted_plain_arguments_are_fine(tmp_path: Path) -> None:
    call = _call(tmp_path, 'cuda_archs_loose_intersection(X 12.0f "${CUDA_ARCHS}")\n')
    assert (call.unresolved, call.evaluated_args) == ("", ("12.0f", "${CUDA_ARCHS}"))


WRAPPER = ('function(cuda_archs_sm120 OUT TGT)\n'
           '  cuda_archs_loose_intersection(${OUT} "12.0f" "${TGT}")\nendfunction()\n')


def test_a_wrapper_call_from_utils(tmp_path: Path) -> None:
    call = _call(tmp_path, 'cuda_archs_sm120(FP4_ARCHS "${CUDA_ARCHS}")\n', WRAPPER)
    assert (call.function, call.variable, call.arch_list, call.list_arg) == (
        "cuda_archs_sm120", "FP4_ARCHS", None, None)
    assert (call.evaluated_args, call.unresolved, call.may_give_sm12x) == (
        ("${CUDA_ARCHS}",), "", True)


def test_wrappers_in_utils_are_known_when_only_other_files_are_scanned(tmp_path: Path) -> None:
    source = _tree(tmp_path, 'cuda_archs_sm120(FP4_ARCHS "${CUDA_ARCHS}")\n', WRAPPER)
    (call,) = find_calls(source, ("CMakeLists.txt",))
    assert (call.function, call.unresolved) == ("cuda_archs_sm120", "")
    (source / "cmake" / "utils.cmake").write_text("function(x\n")
    with pytest.raises(Sm121Error, match=r"^cmake/utils\.cmake: cannot read it as CMake"):
        find_calls(source, ("CMakeLists.txt",))
    (source / "cmake" / "utils.cmake").write_text("")
    assert find_calls(source, ("CMakeLists.txt",)) == []
    (source / "cmake" / "utils.cmake").unlink()
    (source / "cmake" / "utils.cmake").mkdir()
    assert find_calls(source, ("CMakeLists.txt",)) == []


def test_a_wrapper_needs_the_target_list_and_to_live_in_utils(tmp_path: Path) -> None:
    call = _call(tmp_path, 'cuda_archs_sm120(FP4_ARCHS "9.0")\n', WRAPPER)
    assert call.unresolved == 'its target list is not "${CUDA_ARCHS}"'
    call = _call(tmp_path / "b", WRAPPER + 'cuda_archs_sm120(FP4_ARCHS "${CUDA_ARCHS}")\n')
    assert call.unresolved == "cuda_archs_sm120 is defined in CMakeLists.txt, not " \
                              "cmake/utils.cmake"
    assert call.evaluated_args is None


def test_calls_in_order_outside_functions_without_the_narrowing(tmp_path: Path) -> None:
    source = _tree(tmp_path, (
        'cuda_archs_loose_intersection(CUDA_ARCHS "${CUDA_SUPPORTED_ARCHS}" "${CUDA_ARCHS}")\n'
        "cuda_archs_loose_intersection()\n"
        "endfunction()\n"
        'cuda_archs_loose_intersection(A "12.0f" "${CUDA_ARCHS}")\n'
        "function(f)\n  function(g)\n  endfunction()\n"
        '  cuda_archs_loose_intersection(IN_F "12.0f" "${CUDA_ARCHS}")\nendfunction()\n'
        'CUDA_ARCHS_LOOSE_INTERSECTION(B "12.0f" "${CUDA_ARCHS}")\n'
        'macro(m)\n  cuda_archs_loose_intersection(IN_M "12.0f" "${CUDA_ARCHS}")\nendmacro()\n'
        'cuda_archs_loose_intersection(AFTER_M "12.0f" "${CUDA_ARCHS}")\n'),
        **{"external/fa": 'cuda_archs_loose_intersection(C "8.0" "${CUDA_ARCHS}")\n'})
    (source / "csrc").mkdir()
    (source / "csrc" / "other.cmake").write_text(
        'cuda_archs_loose_intersection(D "8.0" "${CUDA_ARCHS}")\n')
    found = [(c.file, c.line, c.variable) for c in find_calls(source)]
    assert found == [("CMakeLists.txt", 4, "A"), ("CMakeLists.txt", 10, "B"),
                     ("CMakeLists.txt", 14, "AFTER_M"), ("cmake/external/fa.cmake", 1, "C")]
    assert [c.variable for c in find_calls(source, ("csrc/*.cmake",))] == ["D"]
    (source / "cmake" / "external" / "fa.cmake").write_text("if(\n")
    with pytest.raises(Sm121Error, match=r"^cmake/external/fa\.cmake: cannot read it as CMake"):
        find_calls(source)


# --- the supported-archs block -------------------------------------------------------------------

def test_supported_archs_block(tmp_path: Path) -> None:
    blocks = [
        'set(CUDA_SUPPORTED_ARCHS "8.0;9.0")',
        f'if({GE13})\n  if(Y)\n    list(APPEND CUDA_SUPPORTED_ARCHS "12.0")\n  endif()\n'
        'else()\n  set(CUDA_SUPPORTED_ARCHS "12.1")\nendif()',
        'list(REMOVE_ITEM CUDA_SUPPORTED_ARCHS "8.0")',
    ]
    text = ("cmake_minimum_required(VERSION 3.26)\n" + blocks[0] + "  # base\n"
            'set(CUDA_ARCHS "${CUDA_ARCHS}")\nif(X)\n  set(OTHER "1")\nendif()\n'
            + blocks[1] + "\n"
            'cuda_archs_loose_intersection(FP4 "12.0f" "${CUDA_ARCHS}")\n'
            'list(APPEND OTHER_ARCHS "11.0")\nset(CUDA_ARCHS_EXTRA 1)\n' + blocks[2] + "\n"
            'cuda_archs_loose_intersection(CUDA_ARCHS "${CUDA_SUPPORTED_ARCHS}" "${CUDA_ARCHS}")\n'
            'set(CUDA_SUPPORTED_ARCHS "99.0")\n')
    source = _tree(tmp_path, text)
    assert supported_archs_block(source) == blocks


def test_supported_archs_block_without_cmakelists_or_with_a_stray_endif(tmp_path: Path) -> None:
    assert supported_archs_block(_tree(tmp_path, None)) == []
    stray = _tree(tmp_path / "b", 'endif()\nif(A)\n  set(CUDA_SUPPORTED_ARCHS "1")\nendif()\n')
    assert supported_archs_block(stray) == ['if(A)\n  set(CUDA_SUPPORTED_ARCHS "1")\nendif()']
    (stray / "CMakeLists.txt").write_text('set(A "x)\n')
    with pytest.raises(Sm121Error, match=r"^CMakeLists\.txt: cannot read it as CMake"):
        supported_archs_block(stray)


# --- the cmake -P driver (real cmake) -------------------------------------------------------------

def test_the_driver_passes_arguments_verbatim_and_resets_the_output(tmp_path: Path) -> None:
    source = _tree(tmp_path, "", ECHO)
    results, effective = _run(source, ArchList.parse("12.1,9.0"), "13.0", [
        ("sm121_echo", ('a"b\\c;d|e;;f;xSM121GUARD|y',), (), ()),
        ("sm121_nothing", (), (), ()), ("sm121_echo", ("",), (), ())])
    assert results == {0: ('a"b\\c', "d|e", "f", "xSM121GUARD|y"), 1: (), 2: ()}
    assert effective == "12.1;9.0"


def test_a_narrowing_that_gives_no_arch_list_is_refused(tmp_path: Path) -> None:
    """What the tree's CMake makes of CUDA_ARCHS is its answer, read as outside input: a
    value that is not an arch list goes no further than one error."""
    source = _tree(tmp_path, 'set(CUDA_SUPPORTED_ARCHS "12.1")\n', (
        'macro(cuda_archs_loose_intersection OUT A B)\n'
        '  set(${OUT} "12.1;x\\")\nmessage(FATAL_ERROR)\n")\n'
        'endmacro()\n'))
    with pytest.raises(Sm121Error) as error:
        effective_archs(source, ARCHS_121)
    assert str(error.value) == (f"{source}: its CMake narrows the arch list 12.1 to "
                                "'12.1;x\")', which is not an arch list")


def test_the_driver_replays_branches_by_cuda_version(tmp_path: Path) -> None:
    source = _tree(tmp_path, "", ECHO)
    lt13 = "${CMAKE_CUDA_COMPILER_VERSION} VERSION_LESS 13.0"
    invocations = [
        ("sm121_echo", ("in 13",), (((), GE13),), ()),
        ("sm121_echo", ("else of 13",), (((GE13,), "TRUE"),), ()),
        ("sm121_echo", ("elseif",), (((GE13, "${CMAKE_CUDA_COMPILER_VERSION} VERSION_LESS 12.0"),
                                      "${CMAKE_CUDA_COMPILER_VERSION} VERSION_LESS 12.9"),), ()),
        ("sm121_echo", ("nested",), (((), "TRUE"), ((), lt13)), ()),
        ("sm121_echo", ("always",), (), ()),
    ]
    assert _run(source, ARCHS_121, "13.0", invocations)[0] == {0: ("in 13",), 4: ("always",)}
    assert _run(source, ARCHS_121, "12.8", invocations)[0] == {
        1: ("else of 13",), 2: ("elseif",), 3: ("nested",), 4: ("always",)}
    assert _run(source, ARCHS_121, "12.9", invocations)[0] == {
        1: ("else of 13",), 3: ("nested",), 4: ("always",)}


def test_the_driver_narrows_to_the_supported_archs(tmp_path: Path) -> None:
    source = _tree(tmp_path, (
        f'if({GE13})\n  set(CUDA_SUPPORTED_ARCHS "9.0;12.0")\nelse()\n'
        '  set(CUDA_SUPPORTED_ARCHS "9.0;12.0;12.1")\nendif()\n'
        'cuda_archs_loose_intersection(CUDA_ARCHS "${CUDA_SUPPORTED_ARCHS}" "${CUDA_ARCHS}")\n'))
    # the fixture's plain entries pass only on an equal request: 12.1 is lost with CUDA 13
    assert str(effective_archs(source, ArchList.parse("9.0;12.1"))) == "9.0"
    assert str(effective_archs(source, ArchList.parse("9.0;12.1"), "12.9")) == "9.0;12.1"
    assert str(effective_archs(_tree(tmp_path / "b", ""), ArchList.parse("12.1;12.1a"))) == \
        "12.1;12.1a"


def test_the_driver_runs_in_a_scratch_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             ) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    source = _tree(tmp_path, "", ECHO)
    assert _run(source, ARCHS_121, "13.0", [("sm121_stray", (), (), ())])[0] == {0: ()}
    assert list(here.iterdir()) == []


def test_the_driver_errors(tmp_path: Path) -> None:
    source = _tree(tmp_path, "")
    with pytest.raises(Sm121Error) as error:
        _run(source, ARCHS_121, "13", [])
    assert str(error.value) == "unknown CUDA version '13': expected e.g. 13.0"
    for bad in ("13.0.1", "v13.0", "13.x"):
        with pytest.raises(Sm121Error, match=r"^unknown CUDA version"):
            _run(source, ARCHS_121, bad, [])
    (source / "cmake" / "utils.cmake").unlink()
    with pytest.raises(Sm121Error) as error:
        _run(source, ARCHS_121, "bad", [])  # the tree is checked first
    assert str(error.value) == f"{source}: no cmake/utils.cmake; is this a vLLM source tree?"


def test_a_failing_utils_is_one_error_with_cmakes_message(tmp_path: Path) -> None:
    source = _tree(tmp_path, "")
    utils = source.resolve() / "cmake" / "utils.cmake"
    utils.write_text('# broken\nmessage(FATAL_ERROR "broken utils")\n')
    with pytest.raises(Sm121Error) as error:
        _run(source, ARCHS_121, "13.0", [])
    assert str(error.value) == (f"cmake -P could not evaluate {utils}: CMake Error at "
                                f"{utils}:2 (message): broken utils")
    utils.write_text("function(x\n")
    with pytest.raises(Sm121Error) as error:
        _run(source, ARCHS_121, "13.0", [])
    assert str(error.value) == (f"cmake -P could not evaluate {utils}: CMake Error at "
                                f"{utils}:1: Parse error. Function missing ending \")\". "
                                "End of file reached.")
    utils.write_text("cmake_language(EXIT 3)\n")
    with pytest.raises(Sm121Error) as error:
        effective_archs(source, ARCHS_121)
    assert str(error.value) == f"cmake -P could not evaluate {utils}: no output"


def test_cmake_error_without_an_error_block_is_the_last_line() -> None:
    assert cmake_error("first\n  last \n\n") == "last"
    assert cmake_error("") == "no output"
    assert cmake_error("-- x\nCMake Error at a.cmake:3 (message):\n  two\n  lines\n"
                       "Call Stack (most recent call first):\n  b.cmake:1 (include)\n\n"
                       "CMake Error at c.cmake:1:\n  second\n") == \
        "CMake Error at a.cmake:3 (message): two lines"
    assert cmake_error("CMake Error: Error processing file: /x") == \
        "CMake Error: Error processing file: /x"


def test_a_relative_source_is_included_by_its_absolute_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path, "", ECHO)
    monkeypatch.chdir(tmp_path)
    assert _run(Path("src"), ARCHS_121, "13.0", [("sm121_echo", ("x",), (), ())])[0] == {0: ("x",)}


# --- evaluate and intersect --------------------------------------------------------------------

def test_evaluate_maps_results_to_calls(tmp_path: Path) -> None:
    source = _tree(tmp_path, (
        'cuda_archs_loose_intersection(A "12.0f;9.0" "${CUDA_ARCHS}")\n'
        'cuda_archs_loose_intersection(B "${UNSET}" "${CUDA_ARCHS}")\n'
        f'if({GE13})\n  cuda_archs_loose_intersection(C "12.0a" "${{CUDA_ARCHS}}")\n'
        'else()\n  cuda_archs_loose_intersection(D "12.1" "${CUDA_ARCHS}")\nendif()\n'
        'cuda_archs_loose_intersection(E "8.0" "${CUDA_ARCHS}")\n'))
    got = [(g.variable, g.result, g.taken) for g in evaluate(source, ArchList.parse("12.1;9.0"))]
    assert got == [("A", ("12.1", "9.0"), True), ("B", None, True), ("C", (), True),
                   ("D", (), False), ("E", (), True)]
    got = [(g.variable, g.result, g.taken) for g in evaluate(source, ARCHS_121, "12.9")]
    assert got == [("A", ("12.1",), True), ("B", None, True), ("C", (), False),
                   ("D", ("12.1",), True), ("E", (), True)]


def test_evaluate_with_given_calls_and_patterns(tmp_path: Path) -> None:
    source = _tree(tmp_path, 'cuda_archs_loose_intersection(A "12.0f" "${CUDA_ARCHS}")\n',
                   **{"external/x": 'cuda_archs_loose_intersection(X "12.1a" "${CUDA_ARCHS}")\n'})
    assert [(g.variable, g.result) for g in evaluate(source, ArchList.parse("12.1a"), patterns=(
        "cmake/external/*.cmake",))] == [("X", ("12.1a",))]
    calls = find_calls(source)
    assert [g.result for g in evaluate(source, ARCHS_121, calls=calls[:1])] == [("12.1",)]


def test_nothing_to_evaluate_runs_no_cmake(tmp_path: Path) -> None:
    source = _tree(tmp_path, 'cuda_archs_loose_intersection(B "${UNSET}" "${CUDA_ARCHS}")\n')
    (source / "cmake" / "utils.cmake").unlink()  # cmake would fail: it is not run
    (guard,) = evaluate(source, ARCHS_121)
    assert (guard.variable, guard.result) == ("B", None)
    assert evaluate(source, ARCHS_121, calls=[]) == []
    assert intersect(source, ARCHS_121, []) == []


def test_intersect_gives_one_result_per_list(tmp_path: Path) -> None:
    source = _tree(tmp_path, "")
    assert intersect(source, ARCHS_121, ["12.0f", "12.0a", "12.1;9.0", "8.0", "12.0f"]) == [
        ("12.1",), (), ("12.1",), (), ("12.1",)]
    assert intersect(source, ArchList.parse("12.1a"), ["12.1a"], "12.9") == [("12.1a",)]



V128 = "${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 12.8"


def test_two_built_up_lists_in_one_argument_are_both_replayed(tmp_path: Path) -> None:
    """`"${A};${B}"` where both are built by steps (and a third set once): every step of
    every variable is replayed, none is left unreplaced."""
    text = (f'set(A "8.0")\nif({V128})\n  list(APPEND A "12.0f")\nendif()\n'
            f'set(B "9.0")\nif({V128})\n  list(APPEND B "10.0f")\nendif()\nset(C "7.5")\n'
            'cuda_archs_loose_intersection(X "${A};${B};${C}" "${CUDA_ARCHS}")\n')
    source = _tree(tmp_path, text)
    (call,) = find_calls(source)
    assert call.unresolved == "" and {s[0].split()[0] for s in call.prelude} == {
        "set(A", "list(APPEND", "set(B"}
    (guard,) = evaluate(source, ArchList.parse("7.5;8.0;9.0;10.0;12.0"), "13.0")
    assert guard.result is not None and set(guard.result) == {"7.5", "8.0", "9.0", "10.0",
                                                              "12.0"}


def test_an_elseif_branch_on_the_cuda_version_is_replayed(tmp_path: Path) -> None:
    text = ('set(L "9.0")\nif(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0)\n'
            f'  list(APPEND L "12.0f")\nelseif({V128})\n  list(APPEND L "12.0a")\nendif()\n'
            'cuda_archs_loose_intersection(X "${L}" "${CUDA_ARCHS}")\n')
    source = _tree(tmp_path, text)
    (call,) = find_calls(source)
    assert call.unresolved == ""
    (guard,) = evaluate(source, ArchList.parse("9.0;12.0"), "12.9")
    assert guard.result is not None and set(guard.result) == {"9.0", "12.0a"}


def test_an_append_of_a_variable_is_not_replayed(tmp_path: Path) -> None:
    call = _call(tmp_path, 'set(A "12.0")\nlist(APPEND A ${Y})\n'
                           'cuda_archs_loose_intersection(X "${A}" "${CUDA_ARCHS}")\n')
    assert call.evaluated_args is None and call.unresolved


def test_a_command_that_only_reads_the_list_is_not_a_step(tmp_path: Path) -> None:
    """`if(NOT A)` and `message(... A)` between the list's steps and the guard read A; only
    set() and list(APPEND …) build it (replaying a lone `if(` would unbalance the script)."""
    text = ('set(A "9.0")\nlist(APPEND A "12.0f")\nif(NOT A)\n  message(STATUS "no A")\n'
            'endif()\nmessage(STATUS A)\n'
            'cuda_archs_loose_intersection(X "${A}" "${CUDA_ARCHS}")\n')
    source = _tree(tmp_path, text)
    (call,) = find_calls(source)
    assert call.unresolved == "" and [s[0] for s in call.prelude] == [
        'set(A "9.0")', 'list(APPEND A "12.0f")']
    (guard,) = evaluate(source, ArchList.parse("9.0;12.0"), "13.0")
    assert guard.result is not None and set(guard.result) == {"9.0", "12.0"}
