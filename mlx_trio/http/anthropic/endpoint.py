"""POST /v1/messages: the Anthropic Messages API, another client of the same engine calls.

The body becomes the same `CompletionCall` a chat completion makes
(`requests.py`) and runs through the shared completion path
(`completion/serve.py`) with Anthropic's renderer (`render.py`). Errors
are Anthropic-shaped (`server/errors.py` chooses the shape by path).
"""

from __future__ import annotations

from quart import Quart, Response, request

from mlx_trio.http.anthropic.objects import MessageShape
from mlx_trio.http.anthropic.render import MessageRenderer
from mlx_trio.http.anthropic.requests import parse_messages
from mlx_trio.http.completion.serve import serve_completion
from mlx_trio.http.server.body import decode_json_object
from mlx_trio.http.server.state import AppState


def register_messages(app: Quart, state: AppState) -> None:
    async def messages() -> Response:
        body = decode_json_object(await request.get_data())
        call = parse_messages(body, template_defaults=state.config.chat_template_args)
        return await serve_completion(state, call, MessageRenderer(MessageShape.new(model=state.model_name())))

    app.add_url_rule("/v1/messages", "messages", messages, methods=["POST"])
