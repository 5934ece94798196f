"""The Responses API routes: create (streamed or not), retrieve, delete, input items, compact.

`POST /v1/responses` parses the body into a `CompletionCall` (`requests.py`)
and runs the shared completion path (`completion/serve.py`) with the
Responses renderer (`render.py`). A finished response is kept in the
store when `store` is true (the default), for `previous_response_id` and
the GET routes, before the client sees its end (`serve_completion`'s
`before_end`): a client may send the next turn the instant the last ends.

The store is the engine's `responses_store` when it has one (a front
process's `RemoteEngine`: one store in the engine's process, shared by every
front, mlx_trio/link/remote_store.py); else a `ResponseStore` of this
incarnation of the app (a restart of the HTTP child empties it).
"""

from __future__ import annotations

import json
import time
import uuid
from functools import partial
from typing import Any

from quart import Quart, Response, request

from mlx_trio.errors import InvalidParameter
from mlx_trio.events import Usage
from mlx_trio.http.completion.serve import serve_completion
from mlx_trio.http.responses.events import ResponseEvents
from mlx_trio.http.responses.items import chat_messages, normalized_input, with_id
from mlx_trio.http.responses.objects import ResponseShape, usage_object
from mlx_trio.http.responses.render import ResponsesRenderer
from mlx_trio.http.responses.requests import ResponsesCall, parse_responses
from mlx_trio.http.responses.store import LocalResponses, ResponseStore, Responses, StoredResponse
from mlx_trio.http.server.body import decode_json_object
from mlx_trio.http.server.errors import HttpError
from mlx_trio.http.server.state import AppState


def register_responses(app: Quart, state: AppState) -> None:
    store = responses_store(state)

    async def create() -> Response:
        body = decode_json_object(await request.get_data())
        parsed = parse_responses(body, template_defaults=state.config.chat_template_args,
                                 previous=await _previous(store, body.get("previous_response_id")))
        events = ResponseEvents(ResponseShape(model=state.model_name(), echo=parsed.echo),
                                custom_tools=parsed.tools.custom, namespaces=parsed.tools.namespaces)
        renderer = ResponsesRenderer(events, forced_tool=parsed.tools.forced_name)
        return await serve_completion(state, parsed.call, renderer, before_end=partial(_keep, store, parsed, events))

    async def retrieve(response_id: str) -> Response:
        return _json((await _stored(store, response_id)).response)

    async def delete(response_id: str) -> Response:
        if not await store.delete(response_id):
            raise _not_found(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(response_id: str) -> Response:
        return _json(_input_items(await _stored(store, response_id)))

    async def compact() -> Response:
        return _json(_compact(decode_json_object(await request.get_data())))

    app.add_url_rule("/v1/responses", "responses", create, methods=["POST"])
    app.add_url_rule("/responses", "responses_unversioned", create, methods=["POST"])
    app.add_url_rule("/v1/responses/compact", "responses_compact", compact, methods=["POST"])
    app.add_url_rule("/v1/responses/<response_id>", "response", retrieve, methods=["GET"])
    app.add_url_rule("/v1/responses/<response_id>", "response_delete", delete, methods=["DELETE"])
    app.add_url_rule("/v1/responses/<response_id>/input_items", "response_input_items", input_items,
                     methods=["GET"])


def responses_store(state: AppState) -> Responses:
    """The engine's shared store (`responses_store`, which only a front process's engine has), else the app's own."""
    shared: Responses | None = getattr(state.engine, "responses_store", None)
    return shared if shared is not None else LocalResponses(ResponseStore(state.config.responses_store_bytes))


async def _previous(store: Responses, previous_id: Any) -> StoredResponse | None:
    """The stored response `previous_response_id` names (a 404 when there is none); None without one."""
    if not isinstance(previous_id, str):
        return None  # absent, or a wrong type the parser names
    found = await store.get(previous_id)
    if found is None:
        raise _not_found(previous_id, param="previous_response_id")
    return found


async def _keep(store: Responses, parsed: ResponsesCall, events: ResponseEvents) -> None:
    """Store the finished response (completed or incomplete: `serve_completion` awaits this only then)."""
    if parsed.store:
        await store.put(StoredResponse(events.response, parsed.input_items, (*parsed.context, *events.output)))


async def _stored(store: Responses, response_id: str) -> StoredResponse:
    found = await store.get(response_id)
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
