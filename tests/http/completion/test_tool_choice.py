"""tool_choice_constraint: the lark grammars for Hermes/Qwen and the generic tool format, checked with llguidance."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.completion.tool_choice import lark_marker, tool_choice_constraint
from mlx_trio.params import Constraint
from mlx_trio.testing import LLAMA, QWEN3_TOOLS, tiny_model

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(str(tiny_model(QWEN3_TOOLS))))


def _accepts(tokenizer: llguidance.LLTokenizer, constraint: Constraint, text: str) -> bool:
    """Whether the grammar lets the model write `text` (tokenized as the model would) and then stop."""
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(constraint.source))
    assert not matcher.is_error(), matcher.get_error()
    hf = AutoTokenizer.from_pretrained(str(tiny_model(QWEN3_TOOLS)))
    for token in hf.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_auto_and_none_need_no_constraint() -> None:
    """Nothing to enforce for "none", nor for "auto" in a native format."""
    assert tool_choice_constraint(TOOLS, "auto", "json_tools") is None
    assert tool_choice_constraint(TOOLS, "none", None) is None
    assert tool_choice_constraint(TOOLS, "none", "generic") is None


def test_required_grammar_is_exact_and_valid() -> None:
    """"required" is a lark grammar: one or more newline-separated calls, one alternative per function."""
    constraint = tool_choice_constraint(TOOLS, "required", "json_tools")
    assert constraint is not None and constraint.kind == "lark"
    lines = constraint.source.splitlines()
    assert lines[:3] == ["%llguidance {}", 'start: call ("\\n" call)*',
                         'call: <tool_call> "\\n" (fn_0 | fn_1) "\\n" </tool_call>']
    assert lines[3].startswith('fn_0: %json {"type": "object", "properties": {"name": {"const": "get_weather"}')
    assert lines[4] == ('fn_1: %json {"type": "object", "properties": {"name": {"const": "get_time"}, '
                        '"arguments": {"type": "object"}}, "required": ["name", "arguments"], '
                        '"additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}')
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(constraint.source)) == ""


def test_required_accepts_calls_and_rejects_text(ll_tokenizer: llguidance.LLTokenizer) -> None:
    """With the model's own tokens: compact calls (one or two) pass; prose, or arguments off the schema, do not."""
    constraint = tool_choice_constraint(TOOLS, "required", "json_tools")
    assert constraint is not None
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert _accepts(ll_tokenizer, constraint, call)
    assert _accepts(ll_tokenizer, constraint, call + '\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>')
    assert not _accepts(ll_tokenizer, constraint, "Sure! " + call)
    assert not _accepts(ll_tokenizer, constraint, call.replace('"city"', '"town"'))


def test_named_function_allows_only_that_function_once(ll_tokenizer: llguidance.LLTokenizer) -> None:
    """A named function: exactly one call of it; another function, or a second call, is refused."""
    constraint = tool_choice_constraint(TOOLS, "function", "json_tools", function_name="get_time")
    assert constraint is not None and "get_weather" not in constraint.source
    call = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    assert _accepts(ll_tokenizer, constraint, call)
    assert not _accepts(ll_tokenizer, constraint, call + "\n" + call)
    assert not _accepts(ll_tokenizer, constraint, call.replace("get_time", "get_weather"))


def test_parallel_false_allows_one_call() -> None:
    """parallel_tool_calls false: the start rule is a single call."""
    constraint = tool_choice_constraint(TOOLS, "required", "json_tools", parallel=False)
    assert constraint is not None and constraint.source.splitlines()[1] == "start: call"


@pytest.mark.parametrize("kind", [None, "mistral", "qwen3_coder"])
def test_formats_without_a_grammar_are_refused(kind: str | None) -> None:
    """"required" on a format we cannot write as a grammar is a 400 on tool_choice, never a silent "auto"."""
    with pytest.raises(InvalidParameter) as info:
        tool_choice_constraint(TOOLS, "required", kind)
    assert info.value.field == "tool_choice"
    assert "use tool_choice 'auto'" in str(info.value)


@pytest.fixture(scope="module")
def llama_tokenizer() -> tuple[llguidance.LLTokenizer, Any]:
    """The tiny Llama (no tool format of its own: the generic one) as llguidance and HF see it."""
    hf = AutoTokenizer.from_pretrained(str(tiny_model(LLAMA)))
    return llguidance.hf.from_tokenizer(hf), hf


def _generic_accepts(tokenizers: tuple[llguidance.LLTokenizer, Any], constraint: Constraint, text: str) -> bool:
    ll, hf = tokenizers
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(constraint.source))
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in hf.encode(text, add_special_tokens=False)) and matcher.is_accepting()


GENERIC_CALL = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}'
TWO_CALLS = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_time","arguments":{}}]}'


def test_generic_auto_allows_text_or_a_valid_call_object(llama_tokenizer: Any) -> None:
    """The generic format's "auto": any text not starting with `{`, an empty answer, or calls on the schemas."""
    constraint = tool_choice_constraint(TOOLS, "auto", "generic")
    assert constraint is not None and constraint.kind == "lark"
    for text in ("", "Hello there.", "  It is {sunny}.", GENERIC_CALL, TWO_CALLS):
        assert _generic_accepts(llama_tokenizer, constraint, text), text
    for text in ('{"answer": 1}', ' {"tool_calls":[]}', GENERIC_CALL.replace("get_weather", "get_rain"),
                 GENERIC_CALL.replace('"city"', '"town"'), GENERIC_CALL + " and more",
                 GENERIC_CALL.replace('":', '": ')):
        assert not _generic_accepts(llama_tokenizer, constraint, text), text


def test_generic_required_named_and_single(llama_tokenizer: Any) -> None:
    """"required": calls only; a named function or parallel false: exactly one call (of that function)."""
    required = tool_choice_constraint(TOOLS, "required", "generic")
    assert required is not None
    assert _generic_accepts(llama_tokenizer, required, TWO_CALLS)
    assert not _generic_accepts(llama_tokenizer, required, "Hello")
    assert not _generic_accepts(llama_tokenizer, required, "")
    single = tool_choice_constraint(TOOLS, "required", "generic", parallel=False)
    assert single is not None and _generic_accepts(llama_tokenizer, single, GENERIC_CALL)
    assert not _generic_accepts(llama_tokenizer, single, TWO_CALLS)
    named = tool_choice_constraint(TOOLS, "function", "generic", function_name="get_time")
    assert named is not None and "get_weather" not in named.source
    assert _generic_accepts(llama_tokenizer, named, '{"tool_calls":[{"name":"get_time","arguments":{}}]}')
    assert not _generic_accepts(llama_tokenizer, named, GENERIC_CALL)


def test_every_grammar_labels_its_tool_schemas_by_field() -> None:
    """Each tool's parameters travel with the grammar under its own field (a named function: only its own)."""
    for kind in ("generic", "json_tools"):
        constraint = tool_choice_constraint(TOOLS, "required", kind)
        assert constraint is not None
        assert [field for field, _ in constraint.schemas] == ["tools[0].function.parameters",
                                                              "tools[1].function.parameters"]
        assert json.loads(constraint.schemas[1][1]) == {"type": "object"}
    named = tool_choice_constraint(TOOLS, "function", "generic", function_name="get_time")
    assert named is not None and [field for field, _ in named.schemas] == ["tools[1].function.parameters"]


@pytest.mark.parametrize("kind", ["json_tools", "generic"])
def test_a_forced_call_can_close_an_open_think_span_first(ll_tokenizer: llguidance.LLTokenizer, kind: str) -> None:
    """`close_reasoning`: the think end, then the call at once; no reasoning, no text. "auto" is left alone."""
    hf = AutoTokenizer.from_pretrained(str(tiny_model(QWEN3_TOOLS)))
    think_end = hf.convert_tokens_to_ids("</think>")
    marker = lark_marker("</think>", [think_end])
    assert marker == f"<[{think_end}]>" and lark_marker("</think>", [7, 8]) == '"</think>"'
    constraint = tool_choice_constraint(TOOLS, "required", kind, close_reasoning=marker)
    assert constraint is not None
    call = ('<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>' if kind == "json_tools"
            else '{"tool_calls":[{"name":"get_time","arguments":{}}]}')
    assert _accepts(ll_tokenizer, constraint, "</think>" + call)
    assert not _accepts(ll_tokenizer, constraint, call)
    assert not _accepts(ll_tokenizer, constraint, "</think>\n\n" + call)
    assert not _accepts(ll_tokenizer, constraint, "Let me think.</think>" + call)
    auto = tool_choice_constraint(TOOLS, "auto", "generic", close_reasoning=marker)
    assert auto == tool_choice_constraint(TOOLS, "auto", "generic")
