"""read_output_format: mlx-lm's markers and parser for a model, and the real detokenizer feeding the router."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_lm.tokenizer_utils import load

from mlx_trio.engine.model.generic_tools import generic_chat
from mlx_trio.engine.model.load import load_model
from mlx_trio.engine.model.output_format import read_output_format
from mlx_trio.engine.model.text import TextStream
from mlx_trio.http.completion.output_router import Content, OutputRouter, Reasoning, ToolCallMade
from mlx_trio.testing import LLAMA, QWEN3_TOOLS, tiny_model

ANSWER = ('<think>Paris it is.</think>Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>')


def test_tool_model_format_is_read_from_its_tokenizer_and_template() -> None:
    """QWEN3_TOOLS: single-token think markers, Hermes <tool_call> markers and mlx-lm's json_tools parser."""
    tokenizer = load(Path(tiny_model(QWEN3_TOOLS)))
    fmt = read_output_format(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert (fmt.think_start, fmt.think_end, fmt.think_start_ids, fmt.think_end_ids) == (
        "<think>", "</think>", (ids[0],), (ids[1],))
    assert (fmt.tool_call_start, fmt.tool_call_end, fmt.tool_parser_kind) == ("<tool_call>", "</tool_call>", "json_tools")
    assert fmt.has_tool_calling and fmt.has_thinking
    assert fmt.parse_tool_call('\n{"name": "f", "arguments": {"a": 1}}\n', None) == {"name": "f", "arguments": {"a": 1}}


def test_chatml_model_has_no_markers_and_calls_tools_in_the_generic_format() -> None:
    """The plain ChatML tiny Llama: no thinking, no native tool calling, so the generic tool format."""
    fmt = read_output_format(load(Path(tiny_model(LLAMA))))
    assert not fmt.has_tool_calling and not fmt.has_thinking and fmt.tool_parser_kind == "generic"
    assert fmt.generic_tools and fmt.accepts_tools
    assert fmt.initial_state([1, 2, 3]) == "normal"


def test_real_detokenizer_token_by_token_feeds_the_router() -> None:
    """The model's own token ids, detokenized one at a time as a session does, route to the exact pieces."""
    tokenizer = load(Path(tiny_model(QWEN3_TOOLS)))
    router = OutputRouter(read_output_format(tokenizer), parse_tool_calls=True)
    text = TextStream(tokenizer.detokenizer)
    pieces = []
    for token in tokenizer.encode(ANSWER, add_special_tokens=False):
        pieces += router.feed(text.add(token).text)
    pieces += router.feed(text.finish().text) + router.finish()
    assert "".join(p.text for p in pieces if isinstance(p, Reasoning)) == "Paris it is."
    assert "".join(p.text for p in pieces if isinstance(p, Content)) == "Sure."
    [call] = [p for p in pieces if isinstance(p, ToolCallMade)]
    assert call.call.name == "get_weather" and json.loads(call.call.arguments) == {"city": "Paris"}


def test_tools_take_the_generic_format_only_where_the_template_has_none() -> None:
    """LoadedModel.encode: the plain ChatML model gets the generic chat; the Qwen one keeps its template's tools."""
    chat = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    model = load_model(str(tiny_model(LLAMA)))
    assert model.encode(chat, tools=tools) == model.tokenizer.apply_chat_template(
        generic_chat(chat, tools), add_generation_prompt=True)
    tool_model = load_model(str(tiny_model(QWEN3_TOOLS)))
    assert tool_model.encode(chat, tools=tools) == tool_model.tokenizer.apply_chat_template(
        chat, tools=tools, add_generation_prompt=True)
