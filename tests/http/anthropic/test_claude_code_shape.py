"""Claude-Code-shaped Messages bodies through the `anthropic` SDK (beta and plain), on a scripted engine.

The engine is a fake with a real model's output format, so these check the
wire: what reaches `Engine.prepare` (the prompt, the template switches,
the tools, the context policy) and that every object and stream event the
server sends validates against the SDK's own types.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pydantic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from tests.http.anthropic.claude_code_body import (
    BETAS,
    MID_SYSTEM,
    SYSTEM_PROMPT,
    TOOL_NAMES,
    claude_code_body,
    without,
)
from tests.http.fakes import FakeEngine, ScriptedEngine
from tests.http.http_helpers import serve_fake, sse_events

from mlx_trio.output_format import OutputFormat

STREAM_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
SDK_ONLY = ("max_tokens", "messages", "system", "tools", "thinking", "output_config", "metadata")


def _sdk(server: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key="sk-ant-dummy", max_retries=0)


@pytest.mark.parametrize("beta", [True, False], ids=["beta", "plain"])
async def test_a_claude_code_body_reaches_the_engine_as_a_chat(tools_format: OutputFormat, beta: bool) -> None:
    """Billing block dropped, system blocks joined, mid-conversation system kept (the engine places it),
    adaptive thinking on, 24 tools, max_tokens 64000 as sent; the answer is a text block."""
    engine = ScriptedEngine(tools_format, ["pong"])
    body = claude_code_body()
    async with serve_fake(engine) as (server, _), _sdk(server) as client:
        if beta:
            message = await client.beta.messages.create(model="claude-opus-4-8", betas=BETAS, timeout=60, **body)
        else:
            message = await client.messages.create(
                model="claude-sonnet-4-6", **{k: body[k] for k in SDK_ONLY},
                extra_body={"context_management": body["context_management"]}, timeout=60)
    assert [(b.type, b.text) for b in message.content] == [("text", "pong")] and message.stop_reason == "end_turn"
    prompt, kwargs = engine.prepared[0]
    assert prompt == [
        {"role": "system", "content": "You are Claude Code." + SYSTEM_PROMPT},
        {"role": "user", "content": "<system-reminder>Today's date is 2026-05-01.</system-reminder>Say pong."},
        {"role": "system", "content": MID_SYSTEM}]
    assert kwargs["chat_template_kwargs"] == {"enable_thinking": True}
    assert [t["function"]["name"] for t in kwargs["tools"]] == list(TOOL_NAMES) and len(TOOL_NAMES) >= 20
    assert kwargs["max_tokens"] == 64000


async def test_keep_billing_header_keeps_the_block() -> None:
    """--keep-billing-header: the first system block stays in the prompt, as sent."""
    engine = FakeEngine(context_length=100_000)
    async with serve_fake(engine, keep_billing_header=True) as (_, http):
        response = await http.post("/v1/messages", json=without(claude_code_body(), "tools"))
    assert response.status_code == 200
    assert engine.prepared[0][0][0]["content"].startswith("x-anthropic-billing-header: cc_version=2.1.197.495;")


async def test_history_with_signed_thinking_and_a_failed_tool_result(tools_format: OutputFormat) -> None:
    """thinking → reasoning_content (its signature dropped), redacted_thinking dropped, the tool_result's
    blocks joined and marked as an error; the later system note stays between the turns."""
    engine = ScriptedEngine(tools_format, ["ok"])
    async with serve_fake(engine) as (server, _), _sdk(server) as client:
        await client.beta.messages.create(model="m", betas=BETAS, timeout=60, **claude_code_body(with_history=True))
    prompt = engine.prepared[0][0]
    assert prompt[3] == {"role": "assistant", "content": "Listing.", "reasoning_content": "The user wants a file listing.",
                         "tool_calls": [{"id": "toolu_01", "type": "function",
                                         "function": {"name": "Bash", "arguments": {"arg": "ls"}}}]}
    assert prompt[4:] == [{"role": "tool", "tool_call_id": "toolu_01", "content": "Error: ls: permission denied"},
                          {"role": "user", "content": "Try again."}]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages?beta=true"])
async def test_whole_message_validates_and_stream_events_validate(tools_format: OutputFormat, path: str) -> None:
    """The whole message parses as the SDK's `Message`; each stream event as a `RawMessageStreamEvent`;
    message_start carries the cache fields, message_delta the final usage, pings keep the prefill alive."""
    engine = ScriptedEngine(tools_format, ["<think>Hm.</think>pong", "<think>Hm.</think>pong"])
    body = {"model": "claude-opus-4-8", **claude_code_body()}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": ",".join(BETAS)}
    async with serve_fake(engine) as (_, http):
        whole = await http.post(path, json=body, headers=headers)
        streamed = await http.post(path, json={**body, "stream": True}, headers=headers)
    message = Message.model_validate(whole.json(), strict=True)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.usage.input_tokens == 3 and message.usage.cache_read_input_tokens == 0
    events = [e for e in sse_events(streamed.text) if not e.startswith(":")]
    payloads = [json.loads(e.split("data: ", 1)[1]) for e in events]
    for payload in payloads:
        if payload["type"] != "ping":  # the SDK skips pings before it parses an event
            STREAM_EVENT.validate_python(payload)
    kinds = [p["type"] for p in payloads]
    assert kinds[:3] == ["message_start", "ping", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert payloads[0]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0, "cache_read_input_tokens": 0,
                                               "cache_creation_input_tokens": 0}
    assert payloads[-2]["usage"] == {"input_tokens": 3, "output_tokens": len("<think>Hm.</think>pong"),
                                     "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("beta", [True, False], ids=["beta", "plain"])
async def test_count_tokens_is_what_the_request_prefills(tools_format: OutputFormat, beta: bool) -> None:
    """count_tokens (plain and ?beta=true) takes the same body, max_tokens aside, and returns the request's
    input tokens; the engine counts exactly what it would render (same prompt, template switches, tools)."""
    engine = ScriptedEngine(tools_format, ["pong"])
    body = claude_code_body(with_history=True)
    async with serve_fake(engine) as (server, _), _sdk(server) as client:
        if beta:
            counted = await client.beta.messages.count_tokens(model="m", betas=BETAS, **without(body, "max_tokens",
                                                                                               "metadata"))
        else:
            counted = await client.messages.count_tokens(model="m", **without(body, "max_tokens", "metadata",
                                                                              "context_management"))
        message = await client.beta.messages.create(model="m", betas=BETAS, timeout=60, **body)
    assert isinstance(counted, MessageTokensCount) or counted.input_tokens
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == 6


async def test_max_tokens_over_the_context_is_clamped_and_reported_as_max_tokens() -> None:
    """max_tokens 64000 on a context of 10: the answer runs to the context's end, stop_reason max_tokens."""
    async with serve_fake(FakeEngine(context_length=10)) as (server, _), _sdk(server) as client:
        message = await client.messages.create(model="m", max_tokens=64000, timeout=60,
                                               messages=[{"role": "user", "content": "hi"}])
    assert message.stop_reason == "max_tokens" and message.usage.input_tokens + message.usage.output_tokens == 10


async def test_a_prompt_over_the_context_says_prompt_is_too_long() -> None:
    """The words harnesses read to compact: invalid_request_error "prompt is too long: N tokens > M maximum"."""
    async with serve_fake(FakeEngine(context_length=3)) as (server, _), _sdk(server) as client:
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}] * 3)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.body["error"]["message"].startswith("prompt is too long: 3 tokens > 2 maximum")


def _history(*blocks: dict[str, Any], role: str = "user") -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"arg": "ls"}}]},
        {"role": role, "content": list(blocks)}]


TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1"}


@pytest.mark.parametrize(("body", "says"), [
    ({"messages": _history({**RESULT, "content": "ok"})}, "messages[1].content[0].name: names the tool 'Bash'"),
    ({"tools": TOOLS, "messages": _history({**RESULT, "tool_use_id": "toolu_9"})}, "toolu_9' answers no tool_use"),
    ({"tools": TOOLS, "messages": _history({**RESULT, "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]})},
     "'image' blocks in a tool_result are not supported"),
    ({"tools": TOOLS, "messages": _history({"type": "image", "source": {}})}, "reads text only"),
    ({"tools": TOOLS, "messages": _history({**RESULT, "content": [{"type": "text"}]})}, "must be a text block"),
    ({"tools": TOOLS, "messages": _history({"type": "thinking", "thinking": 1}, role="assistant")},
     "messages[2].content[0].thinking"),
    ({"tools": [{"name": "Bash", "input_schema": "object"}], "messages": [{"role": "user", "content": "x"}]},
     "tools[0].input_schema"),
    ({"tools": [{"name": "", "input_schema": {}}], "messages": [{"role": "user", "content": "x"}]}, "tools[0].name"),
    ({"thinking": {"type": "sometimes"}, "messages": [{"role": "user", "content": "x"}]}, "'adaptive'"),
    ({"thinking": {"type": "enabled"}, "messages": [{"role": "user", "content": "x"}]}, "budget_tokens"),
    ({"output_config": {"format": {"type": "xml"}}, "messages": [{"role": "user", "content": "x"}]},
     "output_config.format"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "'user', 'assistant' or 'system'"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}]}, "messages[0].content[0]"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens?beta=true"])
async def test_bad_blocks_and_schemas_are_anthropic_400s(tools_format: OutputFormat, body: dict[str, Any],
                                                         says: str, path: str) -> None:
    """Each is a 400 in Anthropic's error shape naming what to change, on both endpoints; never a 5xx."""
    async with serve_fake(ScriptedEngine(tools_format, [])) as (_, http):
        response = await http.post(path, json={"model": "m", "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert says in payload["error"]["message"]
