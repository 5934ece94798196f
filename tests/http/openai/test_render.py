"""OpenAI streams (`http/openai/render.py`) on the wire: framing, disconnects, the response timeout; a fake engine."""

from __future__ import annotations

import json

import pytest
import trio
from quart_trio import QuartTrio
from werkzeug.datastructures import ImmutableDict

from tests.http.fakes import FakeEngine
from tests.http.http_helpers import serve_fake, sse_events

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
TEXT = {"prompt": "one two", "max_tokens": 3, "stream": True}


async def test_chat_stream_framing() -> None:
    """Role in the first delta only, keepalive comments, content deltas, finish_reason last, [DONE] after."""
    async with serve_fake() as (_, client):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        events = sse_events(response.text)
    assert events[-1] == "data: [DONE]"
    comments = [e for e in events if e.startswith(":")]
    assert comments == [": keepalive 0/1", ": keepalive 1/1"]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1] if e.startswith("data: ")]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["system_fingerprint"] for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == "w0 w1 w2 "
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all("usage" not in c for c in chunks)


async def test_include_usage_adds_a_usage_chunk_before_done() -> None:
    """stream_options.include_usage adds one chunk with empty choices and the usage, then [DONE]."""
    async with serve_fake() as (_, client):
        body = {**TEXT, "stream_options": {"include_usage": True}}
        events = sse_events((await client.post("/v1/completions", json=body)).text)
    assert events[-1] == "data: [DONE]"
    usage_chunk = json.loads(events[-2].removeprefix("data: "))
    assert usage_chunk["object"] == "text_completion"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                    "prompt_tokens_details": {"cached_tokens": 0},
                                    "completion_tokens_details": {"reasoning_tokens": 0}}
    last = json.loads(events[-3].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"


async def test_text_stream_framing() -> None:
    """Text completion chunks carry choices[0].text with object text_completion and a cmpl- id."""
    async with serve_fake() as (_, client):
        events = sse_events((await client.post("/v1/completions", json=TEXT)).text)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1] if e.startswith("data: ")]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "w0 w1 w2 "
    assert events[-1] == "data: [DONE]"


async def test_stop_string_finishes_with_stop() -> None:
    """A matched stop string ends the stream with finish_reason "stop"."""
    async with serve_fake() as (_, client):
        body = {**TEXT, "max_tokens": 10, "stop": ["w2"]}
        events = sse_events((await client.post("/v1/completions", json=body)).text)
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "stop"


async def test_client_disconnect_closes_the_engine_stream() -> None:
    """Closing a stream mid-way closes Engine.stream: the row and its KV bytes go away."""
    engine = FakeEngine(context_length=10_000)
    engine.token_delay_s = 0.01
    async with serve_fake(engine) as (_, client):
        async with client.stream("POST", "/v1/completions", json={**TEXT, "max_tokens": 5000}) as response:
            lines = response.aiter_lines()  # kept open: closing it is the disconnect under test
            while not (await lines.__anext__()).startswith("data: {"):
                pass
            assert engine.active == 1
        with trio.fail_after(5):
            while engine.active:
                await trio.sleep(0.01)
        assert engine.kv_bytes == 0 and engine.closed_streams == 1
        stats = (await client.get("/stats")).json()["batch"]
        assert stats["active_rows"] == 0 and stats["kv_bytes"] == 0


async def test_client_disconnect_during_a_non_streamed_request_cancels_it() -> None:
    """A client that gives up on a non-streamed request cancels it too."""
    engine = FakeEngine(context_length=10_000)
    engine.token_delay_s = 0.01
    async with serve_fake(engine) as (server, client):
        with trio.move_on_after(0.3):
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 5000})
        with trio.fail_after(5):
            while engine.active:
                await trio.sleep(0.01)
        assert engine.closed_streams == 1


async def test_streams_outlive_quarts_response_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """quart-trio cuts responses at RESPONSE_TIMEOUT; streams opt out, so a long stream still ends in [DONE]."""
    monkeypatch.setattr(QuartTrio, "default_config",
                        ImmutableDict({**QuartTrio.default_config, "RESPONSE_TIMEOUT": 0.2}))
    engine = FakeEngine(context_length=10_000)
    engine.token_delay_s = 0.02
    async with serve_fake(engine) as (_, client):
        body = {**TEXT, "max_tokens": 25}  # about 0.5 s of tokens
        events = sse_events((await client.post("/v1/completions", json=body)).text)
    assert events[-1] == "data: [DONE]"
    assert sum(e.startswith('data: {"id"') for e in events) == 26
