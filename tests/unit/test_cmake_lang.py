"""The CMake reader: commands, arguments and their exact positions, as CMake reads them."""

from __future__ import annotations

import pytest

from sm121_build.source.cmake_lang import CMakeSyntaxError, commands, variables_in


def test_arguments_of_a_call_split_over_lines_with_comments() -> None:
    text = ('if(X)\n  cuda_archs_loose_intersection(  # the guard\n'
            '      FP4_ARCHS   #[[ a bracket\n comment ]] "12.0f"\n'
            '      "${CUDA_ARCHS}")\nendif()\n')
    found = commands(text)
    assert [c.name for c in found] == ["if", "cuda_archs_loose_intersection", "endif"]
    call = found[1]
    assert call.line == 2
    assert [(a.kind, a.value) for a in call.words] == [
        ("unquoted", "FP4_ARCHS"), ("quoted", "12.0f"), ("quoted", "${CUDA_ARCHS}")]
    assert text[call.words[1].start:call.words[1].end] == '"12.0f"'
    assert text[call.start:call.end].endswith('"${CUDA_ARCHS}")')


def test_commented_out_calls_and_strings_are_not_commands() -> None:
    text = ('# cuda_archs_loose_intersection(FP4_ARCHS "12.0f" "${CUDA_ARCHS}")\n'
            '#[==[\ncuda_archs_loose_intersection(A "12.0f" "${CUDA_ARCHS}")\n]==]\n'
            'message(STATUS "cuda_archs_loose_intersection(B \\"12.0f\\")")\n')
    found = commands(text)
    assert [c.name for c in found] == ["message"]
    assert found[0].words[1].value == 'cuda_archs_loose_intersection(B \\"12.0f\\")'


def test_nested_parentheses_and_bracket_arguments() -> None:
    text = 'if((A AND B) OR NOT (C))\nset(X [=[12.0f;10.0a]=])\n'
    first, second = commands(text)
    assert [a.value for a in first.words] == ["A", "AND", "B", "OR", "NOT", "C"]
    assert [a.value for a in first.arguments].count("(") == 2
    assert (second.words[1].kind, second.words[1].value) == ("bracket", "12.0f;10.0a")
    assert second.key == "set" and second.line == 2


def test_names_are_case_insensitive_keys() -> None:
    (call,) = commands("CUDA_ARCHS_LOOSE_INTERSECTION (V \"12.0f\" \"${CUDA_ARCHS}\")")
    assert call.key == "cuda_archs_loose_intersection" and len(call.words) == 3


@pytest.mark.parametrize("text", ['set(X "unterminated)\n', "set(X Y\n", "#[[ never closed\n"])
def test_unterminated_text_is_an_error(text: str) -> None:
    with pytest.raises(CMakeSyntaxError, match="line 1: unterminated"):
        commands(text)


def test_variable_references() -> None:
    assert variables_in("${A};12.0f;x${B_2}") == ["A", "B_2"]
    assert variables_in("12.0f") == []
