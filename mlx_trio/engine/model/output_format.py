"""Read a model's `OutputFormat` from mlx-lm's tokenizer wrapper, once at load time.

mlx-lm already knows each model's markers: `TokenizerWrapper` infers thinking
tokens from the vocabulary and the tool parser from the chat template (or
`tool_parser_type` in tokenizer_config.json), and `make_text_state_machine`
builds the text matcher mlx_lm.server splits output with. We take those as
they are, so every format mlx-lm supports works here too. A template with
no tool format mlx-lm recognises gets our generic one (`GENERIC_TOOLS`).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import make_text_state_machine

from mlx_trio.output_format import GENERIC_TOOLS, OutputFormat


def read_output_format(tokenizer: Any) -> OutputFormat:
    """The markers, tool parser and text state machine of an mlx-lm `TokenizerWrapper`."""
    has_thinking = bool(getattr(tokenizer, "has_thinking", False))
    has_tools = bool(getattr(tokenizer, "has_tool_calling", False))
    init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    return OutputFormat(
        think_start=tokenizer.think_start if has_thinking else None,
        think_end=tokenizer.think_end if has_thinking else None,
        think_start_ids=tuple(tokenizer.think_start_tokens or ()) if has_thinking else (),
        think_end_ids=tuple(tokenizer.think_end_tokens or ()) if has_thinking else (),
        tool_call_start=tokenizer.tool_call_start if has_tools else None,
        tool_call_end=tokenizer.tool_call_end if has_tools else None,
        tool_parser_kind=init_kwargs.get("tool_parser_type") if has_tools else GENERIC_TOOLS,
        parse_tool_call=tokenizer.tool_parser if has_tools else None,
        # Stop strings are matched by the engine before text reaches the splitter, so none here.
        splitter=make_text_state_machine(tokenizer),
        response_initial_state=getattr(tokenizer, "response_initial_state", None),
    )
