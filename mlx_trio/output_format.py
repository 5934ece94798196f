"""How a model marks reasoning and tool calls in its output: a pure-Python value read from its tokenizer.

`engine/model/output_format.py` builds it from mlx-lm's `TokenizerWrapper` (which
infers the thinking markers from the vocabulary and the tool parser from the
chat template); the HTTP layer reads it through `Engine.output_format`
without importing mlx-lm. Its callables are mlx-lm's own: the tool parser
(`mlx_lm.tool_parsers.<kind>.parse_tool_call`) and the text state machine
(`mlx_lm.generate.TextStateMachine`) whose states are "normal", "reasoning"
and "tool" (plus any a response format adds).

A model whose chat template has no tool format gets our generic one
(`GENERIC_TOOLS`, after llama.cpp's "generic" handler): the tools and an
instruction go into the system prompt (engine/model/generic_tools.py), and
the answer is either plain text or one JSON object, compact as the grammar
writes it (`generic_calls_text`), that the output router reads back
(http/completion/generic_calls.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

NORMAL = "normal"
REASONING = "reasoning"
TOOL = "tool"

# `tool_parser_kind` of a model that calls tools in our generic format.
GENERIC_TOOLS = "generic"
# The generic format's call object: {"tool_calls": [{"name": ..., "arguments": {...}}, ...]}.
GENERIC_CALLS_KEY = "tool_calls"


@attrs.frozen
class OutputFormat:
    """The markers of one model's output format and mlx-lm's objects that act on them.

    `splitter` is an mlx-lm `TextStateMachine` (or None: no markers, all text is
    content); `parse_tool_call(text, tools)` returns a dict (or a list of them)
    with `name` and `arguments`, and raises `ValueError` on text it cannot parse.
    """

    think_start: str | None = None
    think_end: str | None = None
    think_start_ids: tuple[int, ...] = ()
    think_end_ids: tuple[int, ...] = ()
    tool_call_start: str | None = None
    tool_call_end: str | None = None
    # The mlx_lm.tool_parsers module name ("json_tools" for Hermes/Qwen `<tool_call>` JSON),
    # or GENERIC_TOOLS when the template has no tool format and ours is used.
    tool_parser_kind: str | None = None
    parse_tool_call: Callable[[str, Any], Any] | None = None
    splitter: Any = None
    # A response format (mlx_lm.chat_templates) may start generation in its own state.
    response_initial_state: str | None = None

    @property
    def has_tool_calling(self) -> bool:
        """The model has a native tool-call syntax (markers and mlx-lm's parser for it)."""
        return self.parse_tool_call is not None and self.tool_call_start is not None

    @property
    def generic_tools(self) -> bool:
        """Tools are rendered and parsed in our generic format (the template has none of its own)."""
        return self.tool_parser_kind == GENERIC_TOOLS and not self.has_tool_calling

    @property
    def accepts_tools(self) -> bool:
        return self.has_tool_calling or self.generic_tools

    @property
    def has_thinking(self) -> bool:
        return self.think_start is not None

    def initial_state(self, prompt_ids: Sequence[int]) -> str:
        """The state generation starts in: "reasoning" when the prompt ends inside an open think span.

        As mlx_lm.server: templates that open `<think>` in the generation
        prompt make the model's first tokens reasoning, with no start marker.
        """
        if self.response_initial_state is not None:
            return self.response_initial_state
        if not self.think_start_ids or not self.think_end_ids:
            return NORMAL
        start = _rfind(prompt_ids, self.think_start_ids)
        return REASONING if start > _rfind(prompt_ids, self.think_end_ids) else NORMAL


PLAIN = OutputFormat()
# No markers, tools in the generic format: what a plain chat model reads as.
GENERIC = OutputFormat(tool_parser_kind=GENERIC_TOOLS)


def generic_calls_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """`calls` ({"name", "arguments"} each, arguments a dict) as the model writes them in the generic format.

    Compact JSON (no blanks after `,` or `:`), exactly what the call grammar
    allows, so a model's history shows it the syntax it is held to.
    """
    items = [{"name": call["name"], "arguments": call.get("arguments") or {}} for call in calls]
    return json.dumps({GENERIC_CALLS_KEY: items}, ensure_ascii=False, separators=(",", ":"))


def _rfind(ids: Sequence[int], sequence: tuple[int, ...]) -> int:
    n = len(sequence)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == sequence:
            return i
    return -1
