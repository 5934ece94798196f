"""Graceful drain: refuse new work, let running streams finish, cut the rest with an error event and [DONE]."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from mlx_trio.events import PromptProgress, TextDelta
from mlx_trio.http.server.drain import Drain
from mlx_trio.http.server.errors import HttpError
from tests.http.fakes import FakeEngine
from tests.http.http_helpers import CLIENT_TIMEOUT_S, assert_openai_error, cli_server, serve_fake, sse_events

# The tiny model's EOS (<|im_end|>): banned, so a stream runs to max_tokens.
NO_EOS = {"2": -100}


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], started: trio.Event) -> list[str]:
    """POST a streamed completion; set `started` at its first text chunk; return all its SSE events."""
    text = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_text():
            text += chunk
            if '"text":"' in text and not started.is_set():
                started.set()
    return sse_events(text)


def _last_data(events: list[str]) -> dict[str, Any]:
    """The payload of the last event before [DONE]."""
    assert events[-1] == "data: [DONE]", events[-3:]
    return json.loads(events[-2].removeprefix("data: "))


async def _wait_draining(client: httpx.AsyncClient) -> httpx.Response:
    with trio.fail_after(10):
        while (response := await client.get("/health")).status_code != 503:
            await trio.sleep(0.01)
    return response


async def test_drain_lets_running_streams_finish_and_refuses_new_work() -> None:
    """During a drain: running streams end normally, new completions are 503 + Retry-After, /health is 503 "draining"."""
    engine = FakeEngine()
    engine.token_delay_s = 0.05
    async with serve_fake(engine) as (server, client), trio.open_nursery() as nursery:
        results: list[list[str]] = []
        started = [trio.Event(), trio.Event()]
        for event in started:
            nursery.start_soon(lambda e=event: _append(results, _stream(client, {"prompt": "a", "max_tokens": 10}, e)))
        for event in started:
            await event.wait()
        reports = []
        nursery.start_soon(lambda: _append(reports, server.drain(10)))
        health = await _wait_draining(client)
        assert health.json()["status"] == "draining"
        refused = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
        assert_openai_error(refused, 503, code="draining")
        assert refused.headers["Retry-After"] == "1"
    assert [_last_data(events)["choices"][0]["finish_reason"] for events in results] == ["length", "length"]
    assert reports[0].cut == 0 and reports[0].in_flight_at_start == 2


async def test_drain_cuts_what_is_still_running_at_the_timeout() -> None:
    """Past the timeout, a stream ends with an in-band 503 "shutdown" error then [DONE]; a non-streamed
    request gets the 503 itself; both free their engine rows."""
    engine = FakeEngine()
    engine.token_delay_s = 0.5
    async with serve_fake(engine) as (server, client), trio.open_nursery() as nursery:
        streamed: list[list[str]] = []
        plain: list[httpx.Response] = []
        started = trio.Event()
        nursery.start_soon(lambda: _append(streamed, _stream(client, {"prompt": "a", "max_tokens": 50}, started)))
        nursery.start_soon(lambda: _append(plain, client.post("/v1/completions", json={"prompt": "a",
                                                                                        "max_tokens": 50})))
        await started.wait()
        with trio.fail_after(10):
            report = await server.drain(0.2)
    assert report.cut == 2
    error = _last_data(streamed[0])["error"]
    assert error["code"] == "shutdown" and error["type"] == "engine_unavailable"
    assert_openai_error(plain[0], 503, code="shutdown")
    assert engine.active == 0 and engine.kv_bytes == 0


async def _append(into: list[Any], awaitable: Any) -> None:
    into.append(await awaitable)


async def _sigterm_with_two_streams(proc: subprocess.Popen[str], url: str,
                                    max_tokens: int) -> tuple[list[list[str]], httpx.Response, httpx.Response]:
    """Start two streams, SIGTERM the server mid-stream, probe a completion and /health while it drains."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "logit_bias": NO_EOS}
    results: list[list[str]] = []
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        async with trio.open_nursery() as nursery:
            started = [trio.Event(), trio.Event()]
            for event in started:
                nursery.start_soon(lambda e=event: _append(results, _stream(client, body, e)))
            with trio.fail_after(30):
                for event in started:
                    await event.wait()
            proc.send_signal(signal.SIGTERM)
            health = await _wait_draining(client)
            refused = await client.post("/v1/completions", json={"prompt": "new", "max_tokens": 2})
    return results, health, refused


async def test_sigterm_drains_running_streams_then_exits_0(tmp_path: Path) -> None:
    """The real CLI: after SIGTERM two running streams finish normally while new requests get 503; exit 0."""
    async with cli_server(tmp_path) as (proc, url):
        # Long enough that the first stream still runs when the second's first text comes on a loaded 2-core CI
        # box (with 1200 tokens the first once ended before the SIGTERM: 1 request in flight).
        results, health, refused = await _sigterm_with_two_streams(proc, url, max_tokens=3000)
        with trio.fail_after(30):
            assert await trio.to_thread.run_sync(proc.wait) == 0
    # Both streams were running when the drain began (the /health probe may have been too), none was cut.
    drained = re.search(r"(\d+) request\(s\) were in flight, (\d+) cut", (tmp_path / "server.log").read_text())
    assert drained is not None and int(drained[1]) >= 2 and drained[2] == "0"
    assert health.json()["status"] == "draining"
    assert_openai_error(refused, 503, code="draining")
    assert "Retry-After" in refused.headers
    for events in results:
        finished = [json.loads(e[6:]) for e in events if e.startswith("data: {")][-1]
        assert finished["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events if '"text":"' in e and '"text":""' not in e) > 100


async def test_sigterm_past_the_shutdown_timeout_cuts_streams_then_exits_0(tmp_path: Path) -> None:
    """With a short --shutdown-timeout, streams still running end with an error event and [DONE]; exit 0."""
    async with cli_server(tmp_path, "--shutdown-timeout", "0.5") as (proc, url):
        start_s = trio.current_time()
        results, _, refused = await _sigterm_with_two_streams(proc, url, max_tokens=4000)
        with trio.fail_after(30):
            assert await trio.to_thread.run_sync(proc.wait) == 0
    assert trio.current_time() - start_s < 20
    assert_openai_error(refused, 503, code="draining")
    for events in results:
        assert _last_data(events)["error"]["code"] == "shutdown"
    assert re.search(r"request\(s\) were in flight, 2 cut", (tmp_path / "server.log").read_text())



async def test_sigterm_with_a_client_that_never_reads_exits_0(tmp_path: Path) -> None:
    """A stream whose client reads nothing blocks its write; the drain's cut closes that connection; exit 0.

    Without it the blocked write (shielded inside hypercorn) kept the process alive after SIGTERM for ever.
    Big events (20 top logprobs each) fill the socket buffers within the tiny model's context.
    """
    async with cli_server(tmp_path, "--shutdown-timeout", "0.5") as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 3000, "logit_bias": NO_EOS, "stream": True,
                           "logprobs": 20}).encode()
        await sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await trio.sleep(5)  # let the stream fill the buffers and block its write
        start_s = trio.current_time()
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await trio.to_thread.run_sync(proc.wait) == 0
        sock.close()
    assert trio.current_time() - start_s < 0.5 + 5 + 5  # shutdown timeout + the 5 s + slack for a busy box


async def _two_events() -> Any:
    yield PromptProgress(1, 1)
    yield TextDelta("a", (7,))


async def test_next_event_passes_events_then_the_end_of_the_stream() -> None:
    drain, events = Drain(), _two_events()
    assert await drain.next_event(events) == PromptProgress(1, 1)
    assert await drain.next_event(events) == TextDelta("a", (7,))
    with pytest.raises(StopAsyncIteration):
        await drain.next_event(events)
    assert drain.cut_requests == 0


async def test_next_event_after_the_cut_is_a_503_shutdown_and_takes_no_event() -> None:
    drain, taken = Drain(), []

    async def events() -> Any:  # waits as an engine stream does (a channel receive is a checkpoint)
        await trio.lowlevel.checkpoint()
        taken.append(1)
        yield PromptProgress(1, 1)

    drain.cut = True
    with pytest.raises(HttpError) as raised:
        await drain.next_event(events())
    assert raised.value.error.status == 503 and raised.value.error.code == "shutdown"
    assert taken == [] and drain.cut_requests == 1


async def test_the_cut_ends_a_wait_in_progress_and_closes_the_stream() -> None:
    """`run` past its timeout cancels a pending wait: a 503 shutdown; the stream's own cleanup has run."""
    drain, closed = Drain(), trio.Event()

    async def never() -> Any:
        try:
            await trio.sleep_forever()
            yield PromptProgress(0, 1)  # pragma: no cover - never reached
        finally:
            closed.set()

    errors: list[HttpError] = []

    async def wait() -> None:
        with drain.track(), pytest.raises(HttpError) as raised:
            await drain.next_event(never())
        errors.append(raised.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        report = await drain.run(0.0)
    assert closed.is_set() and errors[0].error.code == "shutdown"
    assert report.cut == 1 and drain.in_flight == 0
