"""The output router on the generic tool format: text streams as text, each call comes out as its object closes."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_trio.http.completion.output_router import Content, OutputRouter, Piece, ToolCallMade
from mlx_trio.output_format import GENERIC, generic_calls_text

CALLS = generic_calls_text([{"name": "get_weather", "arguments": {"city": "Pa}ri\"s", "tags": ["[x"]}},
                            {"name": "get_time", "arguments": {}}])


def _feed(deltas: list[str], **options: object) -> list[list[Piece]]:
    """The pieces each delta brings, then (last) what `finish` flushes."""
    router = OutputRouter(GENERIC, **{"parse_tool_calls": True, **options})  # type: ignore[arg-type]
    return [router.feed(d) for d in deltas] + [router.finish()]


def _calls(pieces: list[Piece]) -> list[tuple[int, str, object]]:
    return [(p.index, p.call.name, json.loads(p.call.arguments)) for p in pieces if isinstance(p, ToolCallMade)]


def _content(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces if isinstance(p, Content))


def test_calls_text_is_the_compact_object_the_grammar_writes() -> None:
    """One line of compact JSON: no blanks after `,` or `:` (the call grammar's whitespace)."""
    assert generic_calls_text([{"name": "f", "arguments": {"a": 1, "b": [1, 2]}}]) == \
        '{"tool_calls":[{"name":"f","arguments":{"a":1,"b":[1,2]}}]}'


def test_each_call_comes_out_when_its_object_closes() -> None:
    """Fed a character at a time: call 0 comes with the `}` that closes it, call 1 with its own; nothing else."""
    steps = _feed(list(CALLS))
    first_close = CALLS.index('}},{"name"') + 2
    assert [i for i, pieces in enumerate(steps) if pieces] == [first_close - 1, len(CALLS) - 3]
    everything = [p for pieces in steps for p in pieces]
    assert _calls(everything) == [(0, "get_weather", {"city": "Pa}ri\"s", "tags": ["[x"]}), (1, "get_time", {})]
    assert _content(everything) == ""


def test_text_streams_as_soon_as_its_first_byte_is_not_a_brace() -> None:
    """Leading blanks are held until the first other byte; then text passes through as it came, braces and all."""
    steps = _feed(["\n ", " Hel", "lo {there}"])
    assert [[p.text for p in pieces] for pieces in steps] == [[], ["\n  Hel"], ["lo {there}"], []]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(CALLS) - 1), unique=True).map(sorted))
def test_any_cut_into_deltas_reads_the_same_calls(cuts: list[int]) -> None:
    """However the object is cut into deltas, the same two calls come out and no text."""
    bounds = [0, *cuts, len(CALLS)]
    pieces = [p for step in _feed([CALLS[a:b] for a, b in zip(bounds, bounds[1:])]) for p in step]
    assert _calls(pieces) == [(0, "get_weather", {"city": "Pa}ri\"s", "tags": ["[x"]}), (1, "get_time", {})]
    assert _content(pieces) == ""


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "get_time")]


def _cut_calls(pieces: list[Piece]) -> list[tuple[int, str, str, bool]]:
    return [(p.index, p.call.name, p.call.arguments, p.call.complete) for p in pieces if isinstance(p, ToolCallMade)]


def test_a_cut_object_reports_its_unfinished_call_as_a_cut_call() -> None:
    """max_tokens inside call 1: call 0 stands, call 1 is a cut call (its name settled), no text.

    Before (issue #44, point 3), the cut call's text came back as content.
    """
    cut = CALLS[:CALLS.index('"get_time"') + 7]
    pieces = [p for step in _feed([cut], tools=TOOLS) for p in step]
    assert _cut_calls(pieces) == [(0, "get_weather", json.dumps({"city": "Pa}ri\"s", "tags": ["[x"]}), True),
                                  (1, "get_time", "", False)]
    assert _content(pieces) == ""
    inside = CALLS[:CALLS.index('"Pa}') + 4]
    assert _cut_calls([p for step in _feed([inside], tools=TOOLS) for p in step]) == [
        (0, "get_weather", '{"city":"Pa}', False)]


def test_a_cut_before_the_name_settles_is_dropped_unless_one_function_is_callable() -> None:
    """`{"tool_c`: a call is due (the object holds one at least) but which one is not written yet."""
    early = CALLS[:8]
    assert [p for step in _feed([early], tools=TOOLS) for p in step] == []
    one = [p for step in _feed([early], tools=TOOLS, call_names=["get_time"]) for p in step]
    assert _cut_calls(one) == [(0, "get_time", "", False)] and _content(one) == ""
    # After a whole call and its comma, no other call began: nothing more.
    after = CALLS[:CALLS.index(',{"name":"get_time"') + 1]
    assert _cut_calls([p for step in _feed([after], tools=TOOLS) for p in step]) == [
        (0, "get_weather", json.dumps({"city": "Pa}ri\"s", "tags": ["[x"]}), True)]


def test_without_the_grammar_a_lone_call_object_and_trailing_text_are_read() -> None:
    """A bare {"name", "arguments"} object is one call; blanks after it are dropped, text after it is content."""
    pieces = [p for step in _feed(['{"name": "f", "arguments": {"a": 1}}', "\n", " bye"]) for p in step]
    assert _calls(pieces) == [(0, "f", {"a": 1})] and _content(pieces) == "\n bye"
    other = [p for step in _feed(['{"answer": 42}']) for p in step]
    assert _calls(other) == [] and _content(other) == '{"answer": 42}'


def test_a_request_without_tool_parsing_gets_the_object_as_text() -> None:
    """tool_choice none: the router does not read calls; the object is content as written."""
    pieces = [p for step in _feed([CALLS], parse_tool_calls=False) for p in step]
    assert _calls(pieces) == [] and _content(pieces) == CALLS
