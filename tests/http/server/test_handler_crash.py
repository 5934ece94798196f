"""A crash in one request's HTTP handler (a "raise" fault armed for "http") fails that request only."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio
from tests.goldens import golden
from tests.http.fakes import FakeEngine
from tests.http.http_helpers import CLIENT_TIMEOUT_S, assert_openai_error, serve_fake, served_engine, sse_events


RAISE_AT_HTTP = {"actor": "http", "kind": "raise"}
# Greedy goldens of mlx-lm (goldens/tiny.json), each run more than once at the same time.
GREEDY_CASES = ("greedy_raw", "greedy_chat", "greedy_logit_bias") * 3
TEXT = re.compile(r'"(content|text)":"[^"]')


async def test_the_next_request_alone_gets_a_500_in_its_api_shape() -> None:
    """An armed fault fires in the next request's handler (never in the admin routes that arm and list
    faults): a 500 `internal_error`, Anthropic-shaped on /v1/messages; the request after it is served, and
    the crashes are counted on the server."""
    engine = FakeEngine()
    async with serve_fake(engine, enable_fault_injection=True) as (server, client):
        engine.faults.arm("http", "raise")
        assert (await client.get("/v1/admin/faults")).json()["armed"] == [RAISE_AT_HTTP]
        assert_openai_error(await client.get("/v1/models"), 500, code="internal_error")
        assert (await client.get("/v1/models")).status_code == 200
        engine.faults.arm("http", "raise")
        crashed = await client.post("/v1/messages", json={"model": "m", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert crashed.status_code == 500
        assert crashed.json() == {"type": "error", "error": {"type": "api_error", "message": "internal server error"}}
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/v1/admin/faults")).json()["fired"] == [RAISE_AT_HTTP, RAISE_AT_HTTP]
        assert server.statistics() == {"handler_crashes": 2,
                                       "last_handler_error": "InjectedFault: fault injected into http"}


async def test_a_fault_in_a_running_stream_ends_it_with_an_error_event() -> None:
    """Armed while a stream runs, the fault fires at its next event: an in-band OpenAI error, then [DONE]."""
    engine = FakeEngine()
    engine.token_delay_s = 0.05
    async with serve_fake(engine, enable_fault_injection=True) as (server, client):
        text = ""
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": "a", "max_tokens": 20, "stream": True}) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_text():
                if not text:
                    engine.faults.arm("http", "raise")
                text += chunk
        events = sse_events(text)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "internal_error" and error["type"] == "server_error"
        assert server.crashes.count == 1


def _body(case: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    chat = isinstance(case["prompt"], list)
    body = {**case["params"], "stream": True, "temperature": 0.0, "stream_options": {"include_usage": True},
            **({"messages": case["prompt"]} if chat else {"prompt": case["prompt_ids"]})}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def _stream_case(client: httpx.AsyncClient, case: dict[str, Any],
                       first_text: trio.Semaphore) -> tuple[str, int | None, dict[str, Any] | None]:
    """Stream one golden case; release `first_text` at its first text; return text, completion tokens, error."""
    path, body = _body(case)
    text, tokens, error = "", None, None
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in _released_at_first_text(response.aiter_lines(), first_text)]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        payload = json.loads(line.removeprefix("data: "))
        if "error" in payload:
            error = payload["error"]
            continue
        for choice in payload["choices"]:
            text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if payload.get("usage"):
            tokens = payload["usage"]["completion_tokens"]
    return text, tokens, error


async def _released_at_first_text(lines: AsyncIterator[str], first_text: trio.Semaphore) -> AsyncIterator[str]:
    """The `data:` lines of `lines`; `first_text` is released once, at the first that carries text."""
    released = False
    async for line in lines:
        if not line.startswith("data: "):
            continue
        if not released and TEXT.search(line):
            released = True
            first_text.release()
        yield line


async def test_a_handler_crash_among_eight_streams_fails_that_stream_only() -> None:
    """8 SSE streams on one client; an "http" fault armed over HTTP once all have text: exactly one stream
    ends with an in-band `internal_error`, the other 7 stream exactly their goldens, /health stays 200, the
    `http` child is never restarted (its node counts the crash) and the same client goes on being served."""
    cases = [golden("llama", name) for name in GREEDY_CASES[:8]]
    async with served_engine(enable_fault_injection=True) as (server, engine), httpx.AsyncClient(
            base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
        results: list[tuple[str, int | None, dict[str, Any] | None]] = [("", None, None)] * len(cases)
        first_text = trio.Semaphore(0)

        async def one(i: int) -> None:
            results[i] = await _stream_case(client, cases[i], first_text)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(len(cases)):
                    nursery.start_soon(one, i)
                for _ in cases:
                    await first_text.acquire()
                assert (await client.post("/v1/admin/faults", json=RAISE_AT_HTTP)).status_code == 200
                # The fault fires in the next handler to reach a fault point: wait until a stream's has
                # (the admin routes are exempt), or a /health sent now could be the one it crashes.
                while not (await client.get("/v1/admin/faults")).json()["fired"]:
                    await trio.sleep(0.01)
                assert (await client.get("/health")).status_code == 200
        crashed = [i for i, (_, _, error) in enumerate(results) if error is not None]
        assert len(crashed) == 1
        text, _, error = results[crashed[0]]
        assert error is not None and error["code"] == "internal_error"
        assert cases[crashed[0]]["text"].startswith(text)
        for i, (text, tokens, _) in enumerate(results):
            if i not in crashed:
                assert (text, tokens) == (cases[i]["text"], len(cases[i]["tokens"]))
        assert (await client.get("/health")).status_code == 200
        http = next(c for c in (await client.get("/v1/status")).json()["tree"]["children"] if c["id"] == "http")
        assert http["restarts"] == 0 and http["state"] == "running"
        assert http["stats"] == {"handler_crashes": 1, "last_handler_error": "InjectedFault: fault injected into http"}
        again = await _stream_case(client, cases[0], trio.Semaphore(0))
        assert again == (cases[0]["text"], len(cases[0]["tokens"]), None)
        with trio.fail_after(10):
            while engine.status()["counters"]["kv_bytes"]:
                await trio.sleep(0.02)
