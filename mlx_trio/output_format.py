"""How a model marks reasoning and tool calls in its output: a pure-Python value read from its tokenizer.

`engine/model/output_format.py` builds it from mlx-lm's `TokenizerWrapper` (which
infers the thinking markers from the vocabulary and the tool parser from the
chat template); the HTTP layer reads it through `Engine.output_format`
without importing mlx-lm. Its callables are mlx-lm's own: the tool parser
(`mlx_lm.tool_parsers.<kind>.parse_tool_call`) and the text state machine
(`mlx_lm.generate.TextStateMachine`) whose states are "normal", "reasoning"
and "tool" (plus any a response format adds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

NORMAL = "normal"
REASONING = "reasoning"
TOOL = "tool"


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
    # The mlx_lm.tool_parsers module name ("json_tools" for Hermes/Qwen `<tool_call>` JSON).
    tool_parser_kind: str | None = None
    parse_tool_call: Callable[[str, Any], Any] | None = None
    splitter: Any = None
    # A response format (mlx_lm.chat_templates) may start generation in its own state.
    response_initial_state: str | None = None

    @property
    def has_tool_calling(self) -> bool:
        return self.parse_tool_call is not None and self.tool_call_start is not None

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


def _rfind(ids: Sequence[int], sequence: tuple[int, ...]) -> int:
    n = len(sequence)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == sequence:
            return i
    return -1
