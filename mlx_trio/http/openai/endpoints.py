"""POST /v1/chat/completions (and /chat/completions) and POST /v1/completions.

Each handler reads and decodes the body (413 / 400 before anything else),
parses it into a `CompletionCall` (400 naming the field) and hands it to
the shared completion path (`completion/serve.py`) with OpenAI's renderer
(`render.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from quart import Quart, Response, request

from mlx_trio.http.completion.call import CompletionCall
from mlx_trio.http.completion.serve import serve_completion
from mlx_trio.http.openai.objects import ResponseShape
from mlx_trio.http.openai.render import CompletionRenderer
from mlx_trio.http.openai.requests import parse_chat, parse_text
from mlx_trio.http.server.body import decode_json_object
from mlx_trio.http.server.state import AppState

Parser = Callable[..., CompletionCall]


def register_completions(app: Quart, state: AppState) -> None:
    async def chat() -> Response:
        return await _complete(state, parse_chat)

    async def text() -> Response:
        return await _complete(state, parse_text)

    app.add_url_rule("/v1/chat/completions", "chat_completions", chat, methods=["POST"])
    app.add_url_rule("/chat/completions", "chat_completions_unversioned", chat, methods=["POST"])
    app.add_url_rule("/v1/completions", "completions", text, methods=["POST"])


async def _complete(state: AppState, parse: Parser) -> Response:
    body = decode_json_object(await request.get_data())
    call = parse(body, template_defaults=state.config.chat_template_args)
    renderer = CompletionRenderer(ResponseShape.new(chat=call.chat, model=state.model_name()),
                                  include_usage=call.include_usage)
    return await serve_completion(state, call, renderer)
