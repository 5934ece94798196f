"""POST /v1/chat/completions (and /chat/completions) and POST /v1/completions.

Each handler: read and decode the body (413 / 400 before anything else),
parse it into a `CompletionCall`, let `Engine.prepare` validate and tokenize
(400 naming the field), then either stream SSE or collect the whole answer.
Leaving early, by a client disconnect (quart-trio cancels the handler) or a
closed stream body, closes `Engine.stream`, which cancels the request in the
engine and frees its KV cache. So does a drain that times out (`drain.py`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from quart import Quart, Response, request

from mlx_trio.errors import ActorCrashed, InvalidParameter, RequestError
from mlx_trio.events import Finished, GenerationEvent, TextDelta
from mlx_trio.http.server.errors import api_error, draining
from mlx_trio.http.server.metrics import RequestLog
from mlx_trio.http.completion.output_router import OutputRouter
from mlx_trio.http.openai.requests import CompletionCall, decode_json_object, parse_chat, parse_text
from mlx_trio.http.openai.objects import ResponseShape, gather
from mlx_trio.http.server.sse import HEADERS as SSE_HEADERS
from mlx_trio.http.server.sse import sse_stream
from mlx_trio.http.server.state import AppState, closing
from mlx_trio.logprobs import TokenLogprob

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
    if state.draining:
        raise draining()
    prepared = await prepare(state, call)
    router = chat_router(state, call, prepared) if call.chat else None
    shape = ResponseShape.new(chat=call.chat, model=state.model_name())
    request_log = RequestLog(shape.id, kind="chat" if call.chat else "text", stream=call.stream,
                             metrics=state.metrics)
    state.submitted_rows += 1
    # A drain that times out cuts the wait for the next event: a 503 before the headers, else an in-band error.
    events = state.drain.interruptible(state.engine.stream(prepared))
    if call.stream:
        # Wait for the first event before sending headers, so that errors before any output
        # (a full queue: 503 + Retry-After) keep their status; later ones go in-band.
        first = await first_event(events, request_log)
        frames = sse_stream(first, events, shape, include_usage=call.include_usage, request_log=request_log,
                            router=router, logprobs=call.wants_logprobs)
        response = Response(frames, status=200, headers=SSE_HEADERS, mimetype="text/event-stream")
        # quart-trio bounds sending a response by RESPONSE_TIMEOUT (60 s); a stream may run longer.
        response.timeout = None
        return response
    text, finished, logprobs = await collect(events, request_log)
    wanted = logprobs if call.wants_logprobs else None
    if router is None:
        return _json(shape.complete(text, finished.finish_reason, finished.usage, logprobs=wanted))
    content, reasoning, tool_calls = gather([*router.feed(text), *router.finish()])
    return _json(shape.complete(content, router.finish_reason(finished.finish_reason), finished.usage,
                                reasoning=reasoning, tool_calls=tool_calls, logprobs=wanted))


async def prepare(state: AppState, call: CompletionCall) -> Any:
    """`Engine.prepare_off_loop` of the call; its errors in the body's own terms."""
    try:
        return await state.engine.prepare_off_loop(call.prompt, **call.prepare_kwargs(), **tool_kwargs(state, call))
    except RequestError as exc:
        raise call.in_wire_terms(exc) from None


def tool_kwargs(state: AppState, call: CompletionCall) -> dict[str, Any]:
    """`tools` and the `tool_choice` constraint for `Engine.prepare`; none when the request uses no tools."""
    if not call.tools.active:
        return {}
    fmt = state.engine.output_format
    if not fmt.has_tool_calling:
        raise InvalidParameter("tools", f"the model {state.model_name()!r} has no tool-calling format mlx-lm "
                                        "recognises in its chat template; remove tools or send tool_choice 'none'")
    kwargs: dict[str, Any] = {"tools": call.tools.template_tools()}
    constraint = call.tools.constraint(fmt.tool_parser_kind)
    if constraint is not None:
        if "constraint" in call.sampling:
            raise InvalidParameter("tool_choice", "a required or named tool_choice cannot be combined with "
                                                  "response_format; drop one of them")
        kwargs["constraint"] = constraint
    return kwargs


def chat_router(state: AppState, call: CompletionCall, prepared: Any, *, id_prefix: str = "call_") -> OutputRouter:
    """The router for one chat answer; it starts in reasoning when the prompt left a think span open."""
    return OutputRouter(state.engine.output_format, prompt_ids=getattr(prepared, "prompt_ids", ()),
                        parse_tool_calls=call.tools.active, tools=call.tools.template_tools(), id_prefix=id_prefix)


async def first_event(events: AsyncIterator[GenerationEvent], request_log: RequestLog) -> GenerationEvent:
    # Whatever ends this await (an error, the client leaving) also ends the generator: nothing to close.
    try:
        first = await anext(events)
    except StopAsyncIteration:
        raise ActorCrashed("the generation ended without any event") from None
    except Exception as exc:
        request_log.done(api_error(exc).code or "error")
        raise
    except BaseException:
        request_log.done("cancelled")
        raise
    request_log.saw(first)
    return first


async def collect(events: AsyncIterator[GenerationEvent],
                  request_log: RequestLog) -> tuple[str, Finished, list[TokenLogprob]]:
    """A whole non-streamed generation: its text, its `Finished` and its logprobs; logs the outcome."""
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    outcome = "cancelled"
    try:
        async with closing(events):
            async for event in events:
                request_log.saw(event)
                if isinstance(event, TextDelta):
                    texts.append(event.text)
                    logprobs.extend(event.logprobs)
                elif isinstance(event, Finished):
                    outcome = event.finish_reason
                    return "".join(texts), event, logprobs
        raise ActorCrashed("the generation ended without a finish event")
    except Exception as exc:
        error = api_error(exc)
        outcome = error.code or error.type
        raise
    finally:
        request_log.done(outcome)


def _json(payload: Any) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), status=200, mimetype="application/json")
