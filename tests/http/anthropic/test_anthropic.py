"""POST /v1/messages through the official `anthropic` SDK, against a scripted engine with a real model's markers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import pytest
from tests.http.fakes import FakeEngine, ScriptedEngine
from tests.http.http_helpers import serve_fake, sse_events

from mlx_trio.output_format import OutputFormat

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@asynccontextmanager
async def sdk(fmt: OutputFormat, *scripts: str, api_key: str | None = None,
              key: str = "unused") -> AsyncIterator[tuple[anthropic.AsyncAnthropic, ScriptedEngine]]:
    engine = ScriptedEngine(fmt, list(scripts))
    async with serve_fake(engine, api_key=api_key) as (server, _):
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key=key, max_retries=0)
        async with client:
            yield client, engine


async def test_text_message(tools_format: OutputFormat) -> None:
    """A plain answer: one text block, end_turn, usage in tokens; system and sampling fields reach the engine."""
    async with sdk(tools_format, "Hello there.") as (client, engine):
        # This SDK version no longer has typed sampling arguments; the API still takes them.
        message = await client.messages.create(model="m", max_tokens=50, system="Be brief.", messages=ASK,
                                               stop_sequences=["###"],
                                               extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == len("Hello there.") and message.usage.input_tokens == 2
    prompt, kwargs = engine.prepared[0]
    assert prompt == [{"role": "system", "content": "Be brief."}, *ASK]
    assert {k: kwargs[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stop")} == {
        "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": ["###"]}


async def test_tool_use_and_thinking_blocks(tools_format: OutputFormat) -> None:
    """Reasoning is a thinking block, the call a tool_use block with parsed input; stop_reason tool_use."""
    async with sdk(tools_format, "<think>Need weather.</think>Let me look." + CALL) as (client, engine):
        message = await client.messages.create(model="m", max_tokens=50, messages=ASK, tools=[WEATHER])
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = message.content
    assert thinking.thinking == "Need weather." and text.text == "Let me look."
    assert tool_use.id.startswith("toolu_") and tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    assert engine.prepared[0][1]["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": "Weather in a city"}}]


async def test_stream_event_sequence(tools_format: OutputFormat) -> None:
    """Streaming: message_start, blocks each started/deltaed/stopped in order, message_delta, message_stop."""
    async with (sdk(tools_format, "<think>Hm.</think>Let me look." + CALL) as (client, _),
                client.messages.stream(model="m", max_tokens=50, messages=ASK, tools=[WEATHER]) as stream):
        events = [event async for event in stream]
        final = await stream.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                  "message_delta", "message_stop")]
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "content_block_start",
                     "content_block_stop", "content_block_start", "content_block_stop", "message_delta",
                     "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "Let me look."
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "Hm."
    assert [json.loads(d.partial_json) for d in deltas if d.type == "input_json_delta"] == [{"city": "Paris"}]
    assert final.stop_reason == "tool_use" and final.content[2].input == {"city": "Paris"}
    assert final.usage.output_tokens > 0


async def test_stream_bytes_start_with_message_start_then_a_ping_per_prefill_step() -> None:
    """On the wire: named events, `message_start` and `ping` first, a `ping` per prefill progress, `message_stop` last."""
    async with serve_fake(FakeEngine()) as (_, http):
        response = await http.post("/v1/messages", json={"max_tokens": 2, "messages": ASK, "stream": True})
    events = sse_events(response.text)
    assert [e.split("\n")[0] for e in events[:4]] == ["event: message_start"] + ["event: ping"] * 3
    assert all(e.split("\n")[0] == f"event: {json.loads(e.split('data: ', 1)[1])['type']}" for e in events)
    assert events[-1] == 'event: message_stop\ndata: {"type":"message_stop"}'


async def test_agent_loop_with_tool_result(tools_format: OutputFormat) -> None:
    """tool_use, then a tool_result: the second prompt has the assistant call and a tool message, in order."""
    async with sdk(tools_format, CALL, "Sunny.") as (client, engine):
        first = await client.messages.create(model="m", max_tokens=50, messages=ASK, tools=[WEATHER])
        tool_use = first.content[0]
        history: list[Any] = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                              {"role": "user", "content": [
                                  {"type": "tool_result", "tool_use_id": tool_use.id, "content": "21 C"},
                                  {"type": "text", "text": "Thanks"}]}]
        second = await client.messages.create(model="m", max_tokens=50, messages=history, tools=[WEATHER])
    assert [(b.type, b.text) for b in second.content] == [("text", "Sunny.")]
    prompt = engine.prepared[1][0]
    assert prompt[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": tool_use.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert prompt[2:] == [{"role": "tool", "tool_call_id": tool_use.id, "content": "21 C"},
                          {"role": "user", "content": "Thanks"}]


async def test_stop_sequence_is_reported() -> None:
    """A stop sequence that ends the answer is stop_reason stop_sequence, naming it."""
    async with serve_fake(FakeEngine()) as (server, _), \
            anthropic.AsyncAnthropic(base_url=server.url, api_key="k", max_retries=0) as client:
        message = await client.messages.create(model="m", max_tokens=10, messages=ASK, stop_sequences=["w2"])
    assert message.content[0].text == "w0 w1 "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "w2"


async def test_x_api_key_auth(tools_format: OutputFormat) -> None:
    """With --api-key, the SDK's x-api-key header is accepted and a wrong key is an Anthropic 401."""
    async with sdk(tools_format, "ok", api_key="secret", key="secret") as (client, _):
        message = await client.messages.create(model="m", max_tokens=5, messages=ASK)
        assert message.content[0].text == "ok"
    async with sdk(tools_format, api_key="secret", key="wrong") as (client, _):
        with pytest.raises(anthropic.AuthenticationError) as info:
            await client.messages.create(model="m", max_tokens=5, messages=ASK)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("body", "says"), [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
     "tool_choice.name"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "custom tools"),
])
async def test_bad_bodies_are_anthropic_400s(tools_format: OutputFormat, body: dict[str, Any], says: str) -> None:
    """Each bad body is a 400 with Anthropic's error shape, its message naming what to change."""
    async with serve_fake(ScriptedEngine(tools_format, [])) as (_, http):
        response = await http.post("/v1/messages", json=body)
    assert response.status_code == 400
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert set(payload["error"]) == {"type", "message"} and says in payload["error"]["message"]
