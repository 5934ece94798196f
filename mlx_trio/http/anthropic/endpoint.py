"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API, another client of the same engine calls.

The body becomes the same `CompletionCall` a chat completion makes
(`requests.py`) and runs through the shared completion path
(`completion/serve.py`) with Anthropic's renderer (`render.py`). Errors
are Anthropic-shaped (`server/errors.py` chooses the shape by path).
Claude Code adds `?beta=true` and `anthropic-beta` headers: the routes
ignore both (every beta field this server knows is accepted either way).
"""

from __future__ import annotations

from functools import partial

import trio
from quart import Quart, Response, request

from mlx_trio.errors import RequestError
from mlx_trio.http.anthropic.objects import MessageShape
from mlx_trio.http.anthropic.render import MessageRenderer
from mlx_trio.http.anthropic.requests import parse_count_tokens, parse_messages
from mlx_trio.http.completion.serve import serve_completion, tool_kwargs
from mlx_trio.http.server.body import decode_json_object
from mlx_trio.http.server.info import json_response
from mlx_trio.http.server.state import AppState


def register_messages(app: Quart, state: AppState) -> None:
    config = state.config

    async def messages() -> Response:
        body = decode_json_object(await request.get_data())
        call = parse_messages(body, template_defaults=config.chat_template_args,
                              keep_billing_header=config.keep_billing_header)
        return await serve_completion(state, call, MessageRenderer(MessageShape.new(model=state.model_name())))

    async def count_tokens() -> Response:
        """`{"input_tokens": N}`: the tokens a Messages request with this body would prefill, exactly."""
        body = decode_json_object(await request.get_data())
        call = parse_count_tokens(body, template_defaults=config.chat_template_args,
                                  keep_billing_header=config.keep_billing_header)
        count = partial(state.engine.count_tokens, call.prompt, **call.prepare_kwargs(), **tool_kwargs(state, call))
        try:
            # A worker thread, as for Engine.prepare_off_loop: a long chat template would stall the loop.
            tokens = await trio.to_thread.run_sync(count)
        except RequestError as exc:
            raise call.in_wire_terms(exc) from None
        return json_response({"input_tokens": tokens})

    app.add_url_rule("/v1/messages", "messages", messages, methods=["POST"])
    app.add_url_rule("/v1/messages/count_tokens", "count_tokens", count_tokens, methods=["POST"])
