"""Tools, reasoning and /v1/messages through the real engine, on the tool-capable tiny model (QWEN3_TOOLS).

A random-weight model does not choose to call tools, so the answers here are
steered with `logit_bias` on the marker tokens; the full agent loops need
the grammar of tool_choice "required" (issue8-grammar) to make the model call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from tests.http.http_helpers import ServerThread
from mlx_lm.tokenizer_utils import load

from mlx_trio.config import EngineConfig
from mlx_trio.http import ServerConfig
from mlx_trio.params import SamplingParams
from mlx_trio.testing import QWEN3_TOOLS, tiny_model

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
# For the agent loops: a random-weight model never closes a free string, so the argument is an enum.
WEATHER_IN = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    config = EngineConfig(model=str(tiny_model(QWEN3_TOOLS)), defaults=SamplingParams(max_tokens=8))
    with ServerThread(config, ServerConfig(port=0)) as thread:
        yield thread


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load(tiny_model(QWEN3_TOOLS))


def _bias(tokenizer: Any, token: str) -> dict[str, int]:
    return {str(tokenizer.convert_tokens_to_ids(token)): 100}


def test_tools_and_tool_history_reach_the_chat_template(client: openai.OpenAI, tokenizer: Any) -> None:
    """The prompt is exactly the template rendered with the tools, the assistant call and the tool result."""
    done = client.chat.completions.create(model="m", messages=HISTORY, tools=[WEATHER], max_tokens=2)
    history = [*HISTORY[:1], {**HISTORY[1], "content": "", "tool_calls": [
        {**HISTORY[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        HISTORY[2]]
    expected = tokenizer.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True)
    assert done.usage.prompt_tokens == len(expected)
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=1)
    assert plain.usage.prompt_tokens == len(tokenizer.apply_chat_template(ASK, add_generation_prompt=True))


def test_think_tokens_become_reasoning(client: openai.OpenAI, tokenizer: Any) -> None:
    """Forcing <think> each step: the first opens the span, the rest are its text; nothing reaches content."""
    bias = _bias(tokenizer, "<think>")
    done = client.chat.completions.create(model="m", messages=ASK, max_tokens=4, logit_bias=bias)
    assert done.choices[0].message.model_extra["reasoning"] == "<think>" * 3
    assert done.choices[0].message.content == "" and done.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=4, logit_bias=bias, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == "<think>" * 3
    assert "".join(d.content or "" for d in deltas) == ""


def test_reasoning_tokens_are_in_usage_on_both_openai_wires(client: openai.OpenAI, tokenizer: Any) -> None:
    """Forced <think>: all 4 tokens are reasoning (the marker too); forced </think> (no span open): none."""
    for token, expected in (("<think>", 4), ("</think>", 0)):
        bias = _bias(tokenizer, token)
        done = client.chat.completions.create(model="m", messages=ASK, max_tokens=4, logit_bias=bias)
        assert done.usage.completion_tokens == 4
        assert done.usage.completion_tokens_details.reasoning_tokens == expected
        chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=4, logit_bias=bias,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected
        response = client.responses.create(model="m", input=ASK[0]["content"], max_output_tokens=4,
                                           extra_body={"logit_bias": bias})
        assert response.usage.output_tokens == 4
        assert response.usage.output_tokens_details.reasoning_tokens == expected
        events = list(client.responses.create(model="m", input=ASK[0]["content"], max_output_tokens=4,
                                              extra_body={"logit_bias": bias}, stream=True))
        assert events[-1].type == "response.incomplete"  # max_output_tokens reached
        assert events[-1].response.usage.output_tokens_details.reasoning_tokens == expected


def test_enable_thinking_false_closes_the_span_in_the_prompt(client: openai.OpenAI, tokenizer: Any) -> None:
    """chat_template_kwargs pass through: enable_thinking false renders the empty think span into the prompt."""
    done = client.chat.completions.create(model="m", messages=ASK, max_tokens=1,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    expected = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False)
    assert done.usage.prompt_tokens == len(expected)


def test_an_unfinished_call_comes_back_as_content(client: openai.OpenAI, tokenizer: Any) -> None:
    """Forcing <tool_call>: the call never closes, so at max_tokens its raw text is content, not a tool call."""
    bias = _bias(tokenizer, "<tool_call>")
    done = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=3, logit_bias=bias)
    choice = done.choices[0]
    assert choice.message.content == "<tool_call>" * 3 and choice.message.tool_calls is None
    assert choice.finish_reason == "length"
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=3,
                                                 logit_bias=bias, stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert contents == ["<tool_call>" * 3]  # held back until the end, then given back whole


def test_anthropic_messages_on_the_real_engine(claude: anthropic.Anthropic, tokenizer: Any) -> None:
    """/v1/messages with a tool and a tool_result: input tokens are the rendered template; the stream agrees."""
    messages: list[Any] = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]}]
    tool = {"name": "get_weather", "description": "Weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    message = claude.messages.create(model="m", max_tokens=5, messages=messages, tools=[tool],
                                     extra_body={"temperature": 0})
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": tool["input_schema"],
                                               "description": "Weather in a city"}}]
    # Anthropic's input_tokens leave out what the prompt cache held: the prompt is their sum.
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert prompt == len(tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True))
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens >= 1
    with claude.messages.stream(model="m", max_tokens=5, messages=messages, tools=[tool],
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == prompt
    assert streamed.usage.cache_read_input_tokens > 0  # the same prompt again: read from the cache


def test_openai_agent_loop(client: openai.OpenAI) -> None:
    """tool_choice required makes the model call get_weather; with the result, it answers in text."""
    # One call (as most agent loops ask): a random-weight model left free would chain calls to max_tokens.
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_IN], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="m", messages=history, tools=[WEATHER_IN], tool_choice="none",
                                            max_tokens=8)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content


def test_anthropic_agent_loop(claude: anthropic.Anthropic) -> None:
    """tool_choice any makes the model use the tool; the tool_result turn gets a text answer."""
    tool = {"name": "get_weather", "input_schema": WEATHER_IN["function"]["parameters"]}
    first = claude.messages.create(model="m", max_tokens=200, messages=ASK, tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    tool_use = next(b for b in first.content if b.type == "tool_use")
    assert tool_use.name == "get_weather" and "city" in tool_use.input
    history: list[Any] = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                        "content": "sunny"}]}]
    second = claude.messages.create(model="m", max_tokens=8, messages=history, tools=[tool],
                                    tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
