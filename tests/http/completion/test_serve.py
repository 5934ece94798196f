"""The shared completion path (`http/completion/serve.py`) through a fake renderer: no wire format at all.

The renderer below writes each call it gets as one readable frame, so the
tests see exactly what the path hands a renderer, in which order, and what
it does itself (keep-alive comments, in-band errors, closing the engine stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
from quart import Response

from tests.http.fakes import FakeEngine, ScriptedEngine

from mlx_trio.errors import ActorCrashed
from mlx_trio.events import Finished
from mlx_trio.http import ServerConfig
from mlx_trio.http.completion.call import CompletionCall
from mlx_trio.http.completion.output_router import Piece, ToolCallMade
from mlx_trio.http.completion.serve import serve_completion
from mlx_trio.http.completion.tools import ToolsRequest
from mlx_trio.http.server.app import server_metrics
from mlx_trio.http.server.drain import Drain
from mlx_trio.http.server.errors import ApiError, HttpError
from mlx_trio.http.server.state import AppState
from mlx_trio.logprobs import TokenLogprob
from mlx_trio.output_format import OutputFormat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _shown(pieces: Sequence[Piece]) -> str:
    out = []
    for piece in pieces:
        if isinstance(piece, ToolCallMade):
            out.append(f"call#{piece.index}:{piece.call.name}:{piece.call.id.startswith('fake_')}")
        else:
            out.append(f"{type(piece).__name__.lower()}:{piece.text}")
    return "|".join(out)


class FakeRenderer:
    """Every renderer call as one frame `<call> <what it got>`; `whole` returns the same facts as a dict."""

    id = "fake-1"
    created = 1
    kind = "fake"
    tool_call_prefix = "fake_"

    def opening(self, prompt_tokens: int) -> list[bytes]:
        return [f"opening {prompt_tokens}".encode()]

    def keepalive(self, processed: int, total: int) -> list[bytes]:
        return [f"keepalive {processed}/{total}".encode()]

    def delta(self, pieces: Sequence[Piece], logprobs: Sequence[TokenLogprob] | None) -> list[bytes]:
        return [f"delta {_shown(pieces)} logprobs={None if logprobs is None else len(logprobs)}".encode()]

    def finish(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int) -> list[bytes]:
        return [f"finish {_shown(pieces)} {finished.finish_reason} calls={tool_calls}".encode()]

    def error(self, error: ApiError) -> list[bytes]:
        return [f"error {error.status} {error.code}".encode()]

    def closing(self) -> list[bytes]:
        return [b"closing"]

    def whole(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int,
              logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        return {"pieces": _shown(pieces), "finish": finished.finish_reason, "calls": tool_calls,
                "logprobs": logprobs}


def _state(engine: FakeEngine) -> AppState:
    drain = Drain()
    return AppState(engine, ServerConfig(), drain, server_metrics(engine, drain))


def _call(*, stream: bool, chat: bool = False, prompt: Any = "one two", max_tokens: int = 3,
          tools: ToolsRequest | None = None) -> CompletionCall:
    return CompletionCall(chat=chat, prompt=prompt, sampling={"max_tokens": max_tokens}, chat_template_kwargs=None,
                          stream=stream, include_usage=False, tools=tools or ToolsRequest())


async def _frames(response: Response) -> list[bytes]:
    async with response.response as body:  # type: ignore[attr-defined]
        return [frame async for frame in body]


async def test_a_stream_is_opening_keepalives_deltas_finish_closing() -> None:
    """Every frame is the renderer's, in order: a keep-alive per prefill progress, then the deltas.

    One body chunk (one write) per event: the opening goes with the first event, the closing with the finish.
    """
    response = await serve_completion(_state(FakeEngine()), _call(stream=True), FakeRenderer())
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    assert await _frames(response) == [
        b"opening 2" b"keepalive 0/2", b"keepalive 2/2",
        b"delta content:w0  logprobs=None", b"delta content:w1  logprobs=None", b"delta content:w2  logprobs=None",
        b"finish  length calls=0" b"closing",
    ]


async def test_an_error_after_the_headers_goes_to_the_renderer_and_the_stream_still_closes() -> None:
    """A failure mid-stream: the renderer's error frame, then its closing frames; the engine stream is closed."""
    engine = FakeEngine()
    engine.fail_with = ActorCrashed("boom")
    response = await serve_completion(_state(engine), _call(stream=True), FakeRenderer())
    assert await _frames(response) == [b"opening 2" b"keepalive 0/2", b"error 500 actor_crashed" b"closing"]
    assert engine.active == 0 and engine.closed_streams == 1


async def test_an_error_before_any_event_keeps_its_status() -> None:
    """Nothing was sent yet: the error is raised (the app's handler makes it a status), no renderer frame."""
    engine = FakeEngine()
    engine.fail_before_start = ActorCrashed("full")
    with pytest.raises(ActorCrashed):
        await serve_completion(_state(engine), _call(stream=True), FakeRenderer())


async def test_a_whole_answer_is_the_renderers_body() -> None:
    """Non-streamed: one JSON object, whatever the renderer returns, built from all the pieces."""
    response = await serve_completion(_state(FakeEngine()), _call(stream=False), FakeRenderer())
    assert response.mimetype == "application/json"
    # The same pieces a stream gets, delta by delta.
    assert await response.get_json() == {"pieces": "content:w0 |content:w1 |content:w2 ", "finish": "length",
                                         "calls": 0, "logprobs": None}


async def test_chat_text_is_routed_and_tool_calls_get_the_renderers_id_prefix(tools_format: OutputFormat) -> None:
    """A chat with tools: reasoning, content and the parsed call reach the renderer; the count comes with finish."""
    engine = ScriptedEngine(tools_format, ["<think>Hm.</think>Ok." + CALL, "<think>Hm.</think>Ok." + CALL])
    call = _call(stream=True, chat=True, prompt=[{"role": "user", "content": "hi"}],
                 tools=ToolsRequest((WEATHER,), "auto"))
    frames = await _frames(await serve_completion(_state(engine), call, FakeRenderer()))
    shown = b"".join(f for f in frames if f.startswith(b"delta")).decode()
    assert "reasoning:Hm" in shown and "content:Ok" in shown and "call#0:get_weather:True" in shown
    assert frames[-1] == b"finish  stop calls=1" b"closing"
    whole = await (await serve_completion(_state(engine), _call(stream=False, chat=True, prompt=call.prompt,
                                                                 tools=call.tools), FakeRenderer())).get_json()
    # Routed delta by delta, as the stream was: the same pieces.
    streamed = [frame.decode()[len("delta "):-len(" logprobs=None")] for frame in frames if frame.startswith(b"delta")]
    assert whole["pieces"] == "|".join(p for p in streamed if p) and whole["calls"] == 1
    assert engine.prepared[0][1]["tools"] == [WEATHER]


async def test_leaving_a_stream_early_closes_the_engine_stream() -> None:
    """A client that goes away (the body iterator is closed) cancels the request in the engine."""
    engine = FakeEngine(context_length=10_000)
    response = await serve_completion(_state(engine), _call(stream=True, max_tokens=5000), FakeRenderer())
    async with response.response as body:  # type: ignore[attr-defined]
        async for frame in body:
            if frame.startswith(b"delta"):
                break
    with trio.fail_after(5):
        while engine.active:
            await trio.sleep(0.01)
    assert engine.closed_streams == 1


async def test_a_draining_server_refuses_before_preparing() -> None:
    """While draining, the path answers 503 before `Engine.prepare` runs."""
    engine = FakeEngine()
    state = _state(engine)
    state.draining = True
    with pytest.raises(HttpError) as info:
        await serve_completion(state, _call(stream=True), FakeRenderer())
    assert info.value.error.status == 503 and engine.prepared == []


def test_the_fake_renderer_covers_the_protocol() -> None:
    """The fake implements every method of `Renderer`, so the tests above exercise the whole seam."""
    from mlx_trio.http.completion.renderer import Renderer  # noqa: PLC0415

    members = {name for name in vars(Renderer) if not name.startswith("_")}
    assert members <= set(dir(FakeRenderer)) and {"opening", "delta", "finish", "error", "closing", "whole"} <= members
