"""OutputRouter: a model's text → content, reasoning and tool calls, however the text is cut into deltas."""

from __future__ import annotations

import json
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_trio.http.completion.output_router import Content, OutputRouter, Piece, Reasoning, ToolCallMade
from mlx_trio.output_format import PLAIN, OutputFormat

CALL_F = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_G = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
ANSWER = "<think>The user wants weather.</think>\n\nLet me check." + CALL_F + "\n" + CALL_G


def _route(fmt: OutputFormat, deltas: list[str], **options: object) -> tuple[list[Piece], OutputRouter]:
    router = OutputRouter(fmt, **options)  # type: ignore[arg-type]
    pieces = [p for d in deltas for p in router.feed(d)]
    return pieces + router.finish(), router


def _merged(pieces: list[Piece]) -> list[tuple[str, object]]:
    """Adjacent text pieces of one kind joined, calls without their random ids."""
    out: list[tuple[str, object]] = []
    for piece in pieces:
        if isinstance(piece, ToolCallMade):
            out.append(("call", (piece.index, piece.call.name, json.loads(piece.call.arguments))))
            continue
        kind = "content" if isinstance(piece, Content) else "reasoning"
        if out and out[-1][0] == kind:
            out[-1] = (kind, str(out[-1][1]) + piece.text)
        else:
            out.append((kind, piece.text))
    return out


EXPECTED = [
    ("reasoning", "The user wants weather."),
    ("content", "\n\nLet me check."),
    ("call", (0, "get_weather", {"city": "Paris"})),
    ("call", (1, "get_time", {})),
]


def test_whole_answer_splits_into_reasoning_content_and_two_calls(tools_format: OutputFormat) -> None:
    """One delta: reasoning, the content between, then both calls with indices 0 and 1, counted."""
    pieces, router = _route(tools_format, [ANSWER], parse_tool_calls=True)
    assert _merged(pieces) == EXPECTED
    assert router.num_tool_calls == 2
    ids = [p.call.id for p in pieces if isinstance(p, ToolCallMade)]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_with_an_id_seed_the_calls_ids_follow_from_it_and_their_index(tools_format: OutputFormat) -> None:
    """The same answer names its calls the same way, however its text was cut into deltas."""
    def ids(seed: str, deltas: list[str]) -> list[str]:
        pieces, _ = _route(tools_format, deltas, parse_tool_calls=True, id_seed=seed)
        return [p.call.id for p in pieces if isinstance(p, ToolCallMade)]

    once = ids("chatcmpl-1", [ANSWER])
    assert len(set(once)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in once)
    assert ids("chatcmpl-1", [ANSWER[:40], ANSWER[40:]]) == once and ids("chatcmpl-2", [ANSWER]) != once


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=len(ANSWER) - 1), max_size=30, unique=True))
def test_any_cut_into_deltas_routes_the_same(tools_format: OutputFormat, cuts: list[int]) -> None:
    """Markers split across deltas still match: every cut gives the same pieces, and no marker text leaks."""
    bounds = [0, *sorted(cuts), len(ANSWER)]
    pieces, _ = _route(tools_format, [ANSWER[a:b] for a, b in pairwise(bounds)], parse_tool_calls=True)
    assert _merged(pieces) == EXPECTED
    shown = "".join(p.text for p in pieces if isinstance(p, (Content, Reasoning)))
    assert "<" not in shown and ">" not in shown


def test_prompt_ending_in_an_open_think_starts_in_reasoning(tools_format: OutputFormat) -> None:
    """When the generation prompt opened <think>, text up to </think> is reasoning without a start marker."""
    think, end = tools_format.think_start_ids[0], tools_format.think_end_ids[0]
    pieces, _ = _route(tools_format, ["plan", "</think>", "answer"], prompt_ids=[1, 2, think])
    assert _merged(pieces) == [("reasoning", "plan"), ("content", "answer")]
    closed, _ = _route(tools_format, ["answer"], prompt_ids=[think, 7, end])
    assert _merged(closed) == [("content", "answer")]


def test_calls_are_content_when_the_request_asked_for_no_tool_parsing(tools_format: OutputFormat) -> None:
    """Without tools (or with tool_choice none), a call the model writes anyway stays content, markers and all."""
    pieces, router = _route(tools_format, ["Hi " + CALL_F], parse_tool_calls=False)
    assert _merged(pieces) == [("content", "Hi " + CALL_F)]
    assert router.num_tool_calls == 0


def test_a_malformed_call_is_given_back_as_content(tools_format: OutputFormat) -> None:
    """A closed call that is not JSON, or a cut one that is no call object, comes back as content: no text is lost."""
    bad, router = _route(tools_format, ["<tool_call>not json</tool_call>done"], parse_tool_calls=True)
    assert _merged(bad) == [("content", "<tool_call>not json</tool_call>done")]
    cut, _ = _route(tools_format, ["x<tool_call>not json"], parse_tool_calls=True, tools=[WEATHER_TOOL])
    assert _merged(cut) == [("content", "x<tool_call>not json")]
    assert router.num_tool_calls == 0


def _cut(pieces: list[Piece]) -> list[tuple[str, object]]:
    """Pieces as `_merged`, a call as (index, name, arguments text, complete)."""
    return [("call", (p.index, p.call.name, p.call.arguments, p.call.complete)) if isinstance(p, ToolCallMade)
            else ("content" if isinstance(p, Content) else "reasoning", p.text) for p in pieces]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_a_call_cut_by_max_tokens_is_a_cut_call(tools_format: OutputFormat) -> None:
    """The answer ends inside a call: it is still that call (complete False), its arguments as far as written.

    Before (issue #44, point 3), its text came back as content: a forced call cut by max_tokens read as text.
    """
    tools = [WEATHER_TOOL, TIME_TOOL]
    in_name, router = _route(tools_format, ["x", CALL_F[:30]], parse_tool_calls=True, tools=tools)
    assert CALL_F[:30].endswith('"get_weat')
    assert _cut(in_name) == [("content", "x"), ("call", (0, "get_weather", "", False))]
    assert router.num_tool_calls == 1
    in_arguments, _ = _route(tools_format, [CALL_G, "\n", CALL_F[:CALL_F.index("Paris") + 5]],
                             parse_tool_calls=True, tools=tools)
    assert _cut(in_arguments)[1] == ("call", (1, "get_weather", '{"city": "Paris', False))
    # Before the name tells the two tools apart, the call cannot be named: syntax only, dropped.
    unsettled, router = _route(tools_format, ['<tool_call>\n{"name": "get_'], parse_tool_calls=True, tools=tools)
    assert unsettled == [] and router.num_tool_calls == 0
    # The named function (tool_choice) settles it from the first token.
    named, _ = _route(tools_format, ["<tool_call>"], parse_tool_calls=True, tools=tools, call_names=["get_time"])
    assert _cut(named) == [("call", (0, "get_time", "", False))]
    # A forced answer cut before its call's first byte (the grammar wrote a think end first) is still the call.
    in_span = {"parse_tool_calls": True, "tools": [WEATHER_TOOL], "prompt_ids": tools_format.think_start_ids}
    closed_span, _ = _route(tools_format, ["</think>"], forced=True, **in_span)
    assert _cut(closed_span) == [("call", (0, "get_weather", "", False))]
    unforced, _ = _route(tools_format, ["</think>"], **in_span)
    assert unforced == []


def test_whitespace_after_a_call_is_dropped_unless_text_follows(tools_format: OutputFormat) -> None:
    """The newline between or after calls is call syntax; text after a call keeps its leading whitespace."""
    pieces, _ = _route(tools_format, [CALL_F, "\n", CALL_G, "\n\n"], parse_tool_calls=True)
    assert [kind for kind, _ in _merged(pieces)] == ["call", "call"]
    more, _ = _route(tools_format, [CALL_F, "\n", " Done."], parse_tool_calls=True)
    assert _merged(more)[1:] == [("content", "\n Done.")]


def test_a_held_back_marker_prefix_is_flushed_at_the_end(tools_format: OutputFormat) -> None:
    """Text that only looked like the start of a marker is shown once the answer ends."""
    router = OutputRouter(tools_format, parse_tool_calls=True)
    assert router.feed("a <tool") == [Content("a ")]
    assert router.finish() == [Content("<tool")]


def test_plain_format_passes_text_through() -> None:
    """A model without markers: every delta is content, unchanged."""
    pieces, router = _route(PLAIN, ["<think>x", "</think>"], parse_tool_calls=True)
    assert pieces == [Content("<think>x"), Content("</think>")]
    assert router.num_tool_calls == 0 and router.finish() == []


def _reasoning_tokens(fmt: OutputFormat, deltas: list[tuple[str, int]], **options: object) -> int:
    router = OutputRouter(fmt, **options)  # type: ignore[arg-type]
    for text, tokens in deltas:
        router.feed(text, tokens)
    router.finish()
    return router.reasoning_tokens


def test_reasoning_tokens_count_the_deltas_read_in_the_think_span(tools_format: OutputFormat) -> None:
    """Both markers and the text between count; content before and after does not; a cut marker counts once."""
    answer = [("Hi", 1), ("<think>", 1), ("The user", 2), (" wants", 1), ("</think>", 1), ("\n\nOk.", 3)]
    assert _reasoning_tokens(tools_format, answer) == 5
    # "</th" + "ink>": a marker cut across deltas; each of its deltas was read in the span, so each counts.
    cut = [("<think>", 1), ("Hm", 1), ("</th", 1), ("ink>", 1), ("Ok", 1)]
    assert _reasoning_tokens(tools_format, cut) == 4
    # A delta with no text yet (its text lags a token) counts by the state it was read in.
    assert _reasoning_tokens(tools_format, [("<think>", 1), ("", 1), ("x", 1), ("</think>", 1), ("", 1)]) == 4


def test_reasoning_tokens_from_an_open_think_in_the_prompt(tools_format: OutputFormat) -> None:
    """The template opened <think>: the first tokens are reasoning without a marker of their own."""
    think = tools_format.think_start_ids[0]
    assert _reasoning_tokens(tools_format, [("plan", 2), ("</think>", 1), ("answer", 2)], prompt_ids=[1, think]) == 3


def test_no_reasoning_tokens_without_markers() -> None:
    """A model without thinking markers (or a text completion): its `<think>` is content, counted as such."""
    assert _reasoning_tokens(PLAIN, [("<think>x", 2), ("</think>", 1)]) == 0
