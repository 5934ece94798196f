"""Tool calls and reasoning through the `openai` SDK, against a scripted engine with a real model's markers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from tests.http.fakes import ScriptedEngine
from tests.http.http_helpers import serve_fake

from mlx_trio.output_format import GENERIC, PLAIN, OutputFormat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@asynccontextmanager
async def sdk(fmt: OutputFormat, *scripts: str) -> AsyncIterator[tuple[openai.AsyncOpenAI, ScriptedEngine]]:
    engine = ScriptedEngine(fmt, list(scripts))
    async with serve_fake(engine) as (server, _):
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            yield client, engine


async def _stream(client: openai.AsyncOpenAI, **body: Any) -> list[Any]:
    stream = await client.chat.completions.create(model="m", stream=True, **body)
    return [chunk async for chunk in stream]


async def test_tool_call_non_streamed(tools_format: OutputFormat) -> None:
    """A call becomes message.tool_calls (id, function name, JSON arguments); content before it stays content."""
    async with sdk(tools_format, "Checking." + CALL_WEATHER) as (client, engine):
        done = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert engine.prepared[0][1]["tools"] == [WEATHER]


async def test_parallel_calls_and_content_null(tools_format: OutputFormat) -> None:
    """Two calls in one turn are two tool_calls; with no text around them, content is null."""
    async with sdk(tools_format, CALL_WEATHER + "\n" + CALL_TIME) as (client, _):
        done = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME])
    message = done.choices[0].message
    assert message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"city": "Paris"}, {}]
    assert len({c.id for c in message.tool_calls}) == 2


async def test_tool_calls_streamed(tools_format: OutputFormat) -> None:
    """Streaming: content streams first, each call is an id+name chunk then an arguments chunk, nothing leaks."""
    async with sdk(tools_format, "Checking." + CALL_WEATHER + "\n" + CALL_TIME) as (client, _):
        chunks = await _stream(client, messages=ASK, tools=[WEATHER, TIME])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    assert content == "Checking."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.id is not None, tc.function.name) for tc in calls] == [
        (0, True, "get_weather"), (0, False, None), (1, True, "get_time"), (1, False, None)]
    assert [tc.function.arguments for tc in calls] == ["", '{"city": "Paris"}', "", "{}"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # Content is complete before the first call chunk: the call was held back, not interleaved.
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[:first_call]) == "Checking."


async def test_agent_loop_round_trips_the_tool_result(tools_format: OutputFormat) -> None:
    """Call, tool result, answer: the second request carries the assistant call and the tool message to the template."""
    async with sdk(tools_format, CALL_WEATHER, "It is sunny in Paris.") as (client, engine):
        first = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
        call = first.choices[0].message.tool_calls[0]
        history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        second = await client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None
    sent = engine.prepared[1][0]
    assert sent[1]["tool_calls"] == [{"id": call.id, "type": "function",
                                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert sent[2] == {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}


async def test_reasoning_goes_to_message_reasoning(tools_format: OutputFormat) -> None:
    """The think span is message.reasoning (delta.reasoning when streamed), never content."""
    script = "<think>Paris is in France.</think>The capital is Paris."
    async with sdk(tools_format, script, script) as (client, engine):
        done = await client.chat.completions.create(
            model="m", messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        chunks = await _stream(client, messages=ASK)
    message = done.choices[0].message
    assert message.content == "The capital is Paris."
    assert message.model_extra["reasoning"] == "Paris is in France."
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == "Paris is in France."
    assert "".join(d.content or "" for d in deltas) == "The capital is Paris."
    assert engine.prepared[0][1]["chat_template_kwargs"] == {"enable_thinking": True}


async def test_tool_choice_none_sends_no_tools_and_parses_no_calls(tools_format: OutputFormat) -> None:
    """tool_choice none: the template gets no tools, and call syntax in the answer stays text."""
    async with sdk(tools_format, CALL_WEATHER) as (client, engine):
        done = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert done.choices[0].message.content == CALL_WEATHER
    assert done.choices[0].finish_reason == "stop"
    assert "tools" not in engine.prepared[0][1] or engine.prepared[0][1]["tools"] is None


@pytest.mark.parametrize(("choice", "constrained"), [
    ("required", "fn_1"), ({"type": "function", "function": {"name": "get_time"}}, "get_time"), ("auto", None)])
async def test_tool_choice_sends_the_constraint(tools_format: OutputFormat, choice: Any, constrained: str | None) -> None:
    """"required" and a named function reach the engine as a lark constraint; "auto" as none."""
    async with sdk(tools_format, CALL_TIME) as (client, engine):
        await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice)
    constraint = engine.prepared[0][1].get("constraint")
    if constrained is None:
        assert constraint is None
    else:
        assert constraint.kind == "lark" and constrained in constraint.source


async def test_tools_on_a_model_without_tool_calling_is_a_400() -> None:
    """A format with no tool syntax at all (not even the generic one) refuses tools with a 400 naming `tools`."""
    async with sdk(PLAIN, "x") as (client, _):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
        assert info.value.param == "tools"
        # tool_choice none needs no tool format: served as plain chat.
        done = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none")
        assert done.choices[0].message.content == "x"


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"n": 2}, "n"),
])
async def test_bad_tool_fields_are_400s_naming_the_field(tools_format: OutputFormat, body: dict[str, Any],
                                                         param: str) -> None:
    """Each malformed tool field is a 400 whose param names it."""
    async with serve_fake(ScriptedEngine(tools_format, [])) as (_, http):
        response = await http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


GENERIC_CALL = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_time","arguments":{}}]}'


async def test_the_generic_format_is_read_into_tool_calls() -> None:
    """A model without a tool format: its call object becomes tool_calls; "auto" sends the text-or-call grammar."""
    async with sdk(GENERIC, GENERIC_CALL, "Sunny.") as (client, engine):
        done = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME])
        text = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME])
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert text.choices[0].message.content == "Sunny." and text.choices[0].finish_reason == "stop"
    constraint = engine.prepared[0][1]["constraint"]
    assert constraint.kind == "lark" and "start: (TEXT | calls)?" in constraint.source


async def test_generic_auto_yields_to_response_format_and_a_forced_call_refuses_it() -> None:
    """response_format with "auto": its schema holds the answer; with "required": a 400 on tool_choice."""
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with sdk(GENERIC, "{}") as (client, engine):
        await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], response_format=response_format)
        assert engine.prepared[0][1]["constraint"].kind == "json_schema"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                                 response_format=response_format)
    assert info.value.param == "tool_choice"
