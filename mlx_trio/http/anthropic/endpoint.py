"""POST /v1/messages: the Anthropic Messages API, another client of the same engine calls.

The body becomes the same `CompletionCall` a chat completion makes
(`anthropic_requests.py`), runs through `Engine.prepare` / `Engine.stream`
and the same `OutputRouter`, and comes back as an Anthropic message or as
its SSE events: `message_start`, `ping`, per block `content_block_start`,
`content_block_delta`…, `content_block_stop`, then `message_delta` (stop
reason, output tokens) and `message_stop`. Errors are Anthropic-shaped
(`errors.py` chooses the shape by path); an error after the headers goes
in-band as an `error` event. Leaving early cancels the request in the
engine, as for chat completions.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from quart import Quart, Response, request

from mlx_trio.events import Finished, GenerationEvent, TextDelta
from mlx_trio.http.anthropic.requests import parse_messages
from mlx_trio.http.anthropic.objects import MessageBlocks, MessageShape, stop_reason, usage_object
from mlx_trio.http.openai.endpoints import chat_router, collect, first_event, prepare
from mlx_trio.http.server.errors import draining
from mlx_trio.http.server.metrics import RequestLog
from mlx_trio.http.completion.output_router import OutputRouter
from mlx_trio.http.openai.requests import decode_json_object
from mlx_trio.http.server.sse import HEADERS as SSE_HEADERS, stream_failure
from mlx_trio.http.server.state import AppState, closing


def register_messages(app: Quart, state: AppState) -> None:
    async def messages() -> Response:
        return await _messages(state)

    app.add_url_rule("/v1/messages", "messages", messages, methods=["POST"])


async def _messages(state: AppState) -> Response:
    body = decode_json_object(await request.get_data())
    call = parse_messages(body, template_defaults=state.config.chat_template_args)
    if state.draining:
        raise draining()
    prepared = await prepare(state, call)
    router = chat_router(state, call, prepared, id_prefix="toolu_")
    shape = MessageShape.new(model=state.model_name())
    request_log = RequestLog(shape.id, kind="messages", stream=call.stream, metrics=state.metrics)
    state.submitted_rows += 1
    events = state.drain.interruptible(state.engine.stream(prepared))
    if call.stream:
        first = await first_event(events, request_log)
        frames = _sse(first, events, shape, router, request_log, prompt_tokens=len(getattr(prepared, "prompt_ids", ())))
        response = Response(frames, status=200, headers=SSE_HEADERS, mimetype="text/event-stream")
        response.timeout = None  # as for chat streams: a stream may outlive quart's response timeout
        return response
    text, finished, _ = await collect(events, request_log)
    blocks = MessageBlocks()
    for piece in [*router.feed(text), *router.finish()]:
        blocks.add(piece)
    message = shape.message(blocks.blocks, stop_reason=stop_reason(finished, router.num_tool_calls),
                            stop_sequence=finished.stop_sequence, usage=usage_object(finished.usage))
    return Response(json.dumps(message, ensure_ascii=False), status=200, mimetype="application/json")


def event(payload: dict[str, Any]) -> bytes:
    """One Anthropic SSE event: its type as the event name, the object as data."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


async def _sse(first: GenerationEvent, events: AsyncIterator[GenerationEvent], shape: MessageShape,
               router: OutputRouter, request_log: RequestLog, *, prompt_tokens: int) -> AsyncIterator[bytes]:
    """The event sequence of one streamed message; closing it early cancels the request (see sse.py)."""
    outcome = "cancelled"
    blocks = MessageBlocks()
    try:
        async with closing(events):
            yield event(shape.start_event(prompt_tokens))
            yield event({"type": "ping"})
            item = first
            while True:
                if isinstance(item, TextDelta):
                    for payload in [e for piece in router.feed(item.text) for e in blocks.add(piece)]:
                        yield event(payload)
                elif isinstance(item, Finished):
                    outcome = item.finish_reason
                    for payload in [e for piece in router.finish() for e in blocks.add(piece)] + blocks.close():
                        yield event(payload)
                    yield event({"type": "message_delta",
                                 "delta": {"stop_reason": stop_reason(item, router.num_tool_calls),
                                           "stop_sequence": item.stop_sequence},
                                 "usage": {"output_tokens": item.usage.completion_tokens}})
                    yield event({"type": "message_stop"})
                    return
                item = await anext(events)
                request_log.saw(item)
    except StopAsyncIteration:
        yield event({"type": "error", "error": {"type": "api_error", "message": "the generation ended early"}})
    except Exception as exc:  # noqa: BLE001  (trio.Cancelled is a BaseException and passes through)
        error = stream_failure(exc, shape.id)
        outcome = error.code or error.type
        yield event(error.anthropic_body())
    finally:
        request_log.done(outcome)
