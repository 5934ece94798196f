"""The Responses API routes: create (streamed or not), retrieve, delete, input items, compact.

`POST /v1/responses` runs the shared completion path: parse the body into
a `CompletionCall` (`requests.py`), `Engine.prepare` (400 naming the
field), then stream the engine's events through the output router and the
`ResponseEvents` renderer; a call that is not streamed drains the same
renderer and returns its last response object, so both are the same items.
A finished response is kept in the `ResponseStore` when `store` is true
(the default) for `previous_response_id` and the GET routes. Leaving early
(a client disconnect, a drain that times out) closes `Engine.stream`,
which cancels the request in the engine and frees its KV cache.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from quart import Quart, Response, request

from mlx_trio.errors import ActorCrashed, InvalidParameter, RequestError
from mlx_trio.events import GenerationEvent, PromptProgress, TextDelta, Usage
from mlx_trio.http.openai.endpoints import chat_router, first_event, prepare
from mlx_trio.http.openai.requests import decode_json_object
from mlx_trio.http.responses.events import Event, ResponseEvents
from mlx_trio.http.responses.forced_tool import ForcedToolRouter
from mlx_trio.http.responses.items import chat_messages, normalized_input, with_id
from mlx_trio.http.responses.objects import ResponseShape, usage_object
from mlx_trio.http.responses.requests import ResponsesCall, parse_responses
from mlx_trio.http.responses.store import ResponseStore, StoredResponse
from mlx_trio.http.server.errors import HttpError, draining
from mlx_trio.http.server.metrics import RequestLog
from mlx_trio.http.server.sse import HEADERS as SSE_HEADERS
from mlx_trio.http.server.sse import comment, stream_failure
from mlx_trio.http.server.state import AppState, closing


def register_responses(app: Quart, state: AppState) -> None:
    store = ResponseStore(state.config.responses_store_bytes)

    async def create() -> Response:
        return await _create(state, store)

    async def retrieve(response_id: str) -> Response:
        return _json(_stored(store, response_id).response)

    async def delete(response_id: str) -> Response:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(response_id: str) -> Response:
        return _json(_input_items(_stored(store, response_id)))

    async def compact() -> Response:
        return _json(_compact(decode_json_object(await request.get_data())))

    app.add_url_rule("/v1/responses", "responses", create, methods=["POST"])
    app.add_url_rule("/responses", "responses_unversioned", create, methods=["POST"])
    app.add_url_rule("/v1/responses/compact", "responses_compact", compact, methods=["POST"])
    app.add_url_rule("/v1/responses/<response_id>", "response", retrieve, methods=["GET"])
    app.add_url_rule("/v1/responses/<response_id>", "response_delete", delete, methods=["DELETE"])
    app.add_url_rule("/v1/responses/<response_id>/input_items", "response_input_items", input_items,
                     methods=["GET"])


async def _create(state: AppState, store: ResponseStore) -> Response:
    body = decode_json_object(await request.get_data())
    previous_id = body.get("previous_response_id")
    previous = None
    if isinstance(previous_id, str):
        previous = store.get(previous_id)
        if previous is None:
            raise _not_found(previous_id, param="previous_response_id")
    parsed = parse_responses(body, template_defaults=state.config.chat_template_args, previous=previous)
    if state.draining:
        raise draining()
    try:
        prepared = await prepare(state, parsed.call)
    except RequestError as exc:
        raise parsed.in_wire_terms(exc) from None
    forced = parsed.tools.forced_name
    router = ForcedToolRouter(forced) if forced else chat_router(state, parsed.call, prepared)
    renderer = ResponseEvents(ResponseShape(model=state.model_name(), echo=parsed.echo),
                              custom_tools=parsed.tools.custom, namespaces=parsed.tools.namespaces)
    request_log = RequestLog(renderer.shape.id, kind="responses", stream=parsed.call.stream, metrics=state.metrics)
    state.submitted_rows += 1
    events = state.drain.interruptible(state.engine.stream(prepared))
    # The first event before the headers: errors before any output keep their status (a full queue: 503).
    first = await first_event(events, request_log)
    frames = _frames(first, events, renderer, router, request_log, logprobs=parsed.call.wants_logprobs,
                     on_finish=lambda: _keep(store, parsed, renderer))
    if parsed.call.stream:
        response = Response(_sse(frames, renderer, request_log), status=200, headers=SSE_HEADERS,
                            mimetype="text/event-stream")
        response.timeout = None  # a stream may outlive quart's response timeout
        return response
    async with aclosing(frames):
        async for _ in frames:
            pass
    return _json(renderer.response)


async def _frames(first: GenerationEvent, events: AsyncIterator[GenerationEvent], renderer: ResponseEvents,
                  router: Any, request_log: RequestLog, *, logprobs: bool,
                  on_finish: Callable[[], None]) -> AsyncIterator[Event | bytes]:
    """The events of one response (SSE comments as bytes); engine errors propagate; logs the outcome."""
    outcome = "cancelled"
    try:
        async with closing(events):
            for event in renderer.start():
                yield event
            item = first
            while True:
                if isinstance(item, PromptProgress):
                    yield comment(f"keepalive {item.processed}/{item.total}")
                elif isinstance(item, TextDelta):
                    for event in renderer.pieces(router.feed(item.text), tokens=len(item.token_ids),
                                                 logprobs=item.logprobs if logprobs else ()):
                        yield event
                else:
                    outcome = item.finish_reason
                    closing_events = [*renderer.pieces(router.finish()), *renderer.finish(item)]
                    on_finish()
                    for event in closing_events:
                        yield event
                    return
                item = await anext(events)
                request_log.saw(item)
    except StopAsyncIteration:
        outcome = "error"
        raise ActorCrashed("the generation ended without a finish event") from None
    except Exception:
        outcome = "error"
        raise
    finally:
        request_log.done(outcome)


async def _sse(frames: AsyncIterator[Event | bytes], renderer: ResponseEvents,
               request_log: RequestLog) -> AsyncIterator[bytes]:
    """SSE framing: `event: <type>` and `data: <json>` per event; a failure after the headers goes in-band."""
    try:
        async with aclosing(frames):  # closed however this ends: a client that leaves cancels the request
            async for frame in frames:
                yield frame if isinstance(frame, bytes) else _sse_event(frame)
    except Exception as exc:  # noqa: BLE001  (trio.Cancelled is a BaseException and passes through)
        for event in renderer.fail(stream_failure(exc, renderer.shape.id)):
            yield _sse_event(event)


def _sse_event(event: Event) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def _keep(store: ResponseStore, parsed: ResponsesCall, renderer: ResponseEvents) -> None:
    if parsed.store:
        store.put(StoredResponse(renderer.response, parsed.input_items, (*parsed.context, *renderer.output)))


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    found = store.get(response_id)
    if found is None:
        raise _not_found(response_id)
    return found


def _not_found(response_id: str, *, param: str = "response_id") -> HttpError:
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return HttpError(404, f"no response with id {response_id!r:.80} is stored here (it was never made, was made "
                          "with store false, was deleted or was evicted; see --responses-store-bytes)",
                     code=code, param=param)


def _input_items(stored: StoredResponse) -> dict[str, Any]:
    """`GET .../input_items`: `limit` (1-100, default 20), `order` (asc or desc, default desc), `after` (an id)."""
    args = request.args
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidParameter("order", f"must be 'asc' or 'desc', got {order!r:.40}")
    try:
        limit = int(args.get("limit", "20"))
    except ValueError:
        raise InvalidParameter("limit", "must be an integer between 1 and 100") from None
    if not 1 <= limit <= 100:
        raise InvalidParameter("limit", f"must be an integer between 1 and 100, got {limit}")
    items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
    after = args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidParameter("after", f"is not an item of this response: {after!r:.80}")
        items = items[ids.index(after) + 1:]
    page = [dict(item) for item in items[:limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _compact(body: dict[str, Any]) -> dict[str, Any]:
    """`POST /v1/responses/compact`: the history back as it came (checked, ids added); nothing is summarised.

    Harnesses call it when a conversation nears the context; answering with
    the same items keeps them working (their next turn fails with a context
    error only if it really does not fit).
    """
    items = normalized_input(body.get("input"))
    instructions = body.get("instructions")
    chat_messages(items, instructions=instructions if isinstance(instructions, str) else None)
    output = [with_id(item) for item in items]
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response.compaction", "created_at": int(time.time()),
            "output": output, "usage": usage_object(Usage(0, 0))}


def _json(payload: Any) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), status=200, mimetype="application/json")
