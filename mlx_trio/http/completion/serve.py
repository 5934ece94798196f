"""The one path that serves a completion, for every wire API: prepare, stream or collect, render.

    parse (the wire API's)  →  serve_completion:
        Engine.prepare_off_loop      (400 naming the body's own key, via `CompletionCall.in_wire_terms`)
        Engine.stream, through the drain
        stream: wait for the first event (errors before any output keep their
                status: a full queue is a 503 + Retry-After), then SSE frames:
                the renderer's keep-alives while the prompt prefills, text through the
                output router, an in-band error event after the headers
        collect: every delta, then routed in order
    →  render (the wire API's `Renderer`), with the router's reasoning-token
       count put into the finish's `Usage`

Leaving early, by a client disconnect (quart-trio cancels the handler, or
closes the stream body) or a drain that times out (`server/drain.py`),
closes `Engine.stream`, which cancels the request in the engine and frees
its KV cache. Every request logs one line (`server/metrics.py`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import attrs
from quart import Response

from mlx_trio.errors import ActorCrashed, InvalidParameter, RequestError
from mlx_trio.events import Finished, GenerationEvent, PromptProgress, TextDelta
from mlx_trio.http.completion.call import CompletionCall
from mlx_trio.http.completion.output_router import OutputRouter
from mlx_trio.http.completion.renderer import Renderer
from mlx_trio.http.completion.tool_choice import lark_marker
from mlx_trio.http.server.admin import handler_fault_point
from mlx_trio.http.server.drain import Drain
from mlx_trio.http.server.errors import INTERNAL_ERROR, ApiError, api_error, draining
from mlx_trio.http.server.info import DEFAULT_MODEL_ALIAS
from mlx_trio.http.server.metrics import RequestLog
from mlx_trio.http.server.sse import HEADERS as SSE_HEADERS
from mlx_trio.http.server.state import AppState, HandlerCrashes, closing
from mlx_trio.output_format import PLAIN, REASONING
from mlx_trio.profiling import request_phase
from mlx_trio.supervision.faults import Faults

log = logging.getLogger("mlx_trio.http")

# What a wire API awaits between an answer's end and its last frame (`serve_completion`'s `before_end`).
BeforeEnd = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    pass


async def serve_completion(state: AppState, call: CompletionCall, renderer: Renderer, *,
                           before_end: BeforeEnd = _nothing) -> Response:
    """Serve one parsed request: SSE frames or one JSON object, in `renderer`'s shapes.

    `before_end` is awaited once the answer is whole (after `renderer.finish` or `renderer.whole`) and
    before its last frame or its body goes out: what it does (the Responses store's put) is done by
    the time the client sees the end. If it fails, the stream ends with that error instead (a
    non-streamed request is answered with it).
    """
    if state.draining:
        raise draining()
    arrived = time.perf_counter()
    prepared = await prepare(state, call)
    request_id = getattr(prepared, "request_id", None)
    if request_id is not None:  # the request's timeline under MLX_TRIO_PROFILE (mlx_trio/profiling/requests.py)
        request_phase(request_id, "arrived", arrived)
        request_phase(request_id, "prepared")
    # Text completions are not split: their output is shown as the model wrote it, markers included.
    router = OutputRouter(state.engine.output_format if call.chat else PLAIN,
                          prompt_ids=getattr(prepared, "prompt_ids", ()), parse_tool_calls=call.tools.active,
                          tools=call.tools.callable_tools(), call_names=call.tools.call_names,
                          forced=call.tools.forced,
                          id_prefix=renderer.tool_call_prefix, id_seed=renderer.id)
    request_log = RequestLog(renderer.id, kind=renderer.kind, stream=call.stream, metrics=state.metrics)
    state.submitted_rows += 1
    events = state.engine.stream(prepared)
    # Every wait for an event goes through `_next`: the drain's cut and the "http" fault point.
    next_event = partial(_next, state.drain, state.engine.faults, events)
    if call.stream:
        # Wait for the first event before sending headers, so that errors before any output
        # (a full queue: 503 + Retry-After) keep their status; later ones go in-band.
        first = await _first_event(events, next_event, request_log)
        frames = _stream(first, events, next_event, renderer, router, request_log, state.crashes,
                         logprobs=call.wants_logprobs, prompt_tokens=len(getattr(prepared, "prompt_ids", ())),
                         before_end=before_end)
        response = Response(frames, status=200, headers=SSE_HEADERS,
                            mimetype="text/event-stream")
        # quart-trio bounds sending a response by RESPONSE_TIMEOUT (60 s); a stream may run longer.
        response.timeout = None
        return response
    deltas, finished = await _collect(events, next_event, request_log)
    pieces = [piece for delta in deltas for piece in router.feed(delta.text, len(delta.token_ids))]
    pieces.extend(router.finish())
    logprobs = [item for delta in deltas for item in delta.logprobs] if call.wants_logprobs else None
    body = renderer.whole(pieces, _counted(finished, router), router.num_tool_calls, logprobs)
    await before_end()
    return Response(json.dumps(body, ensure_ascii=False), status=200, mimetype="application/json")


async def prepare(state: AppState, call: CompletionCall) -> Any:
    """`Engine.prepare_off_loop` of the call; its errors in the body's own terms.

    A `max_tokens` over the room the prompt leaves is lowered to it, unless
    `--strict-max-tokens` (then a 400, as a prompt that alone fills the context is).
    """
    try:
        prepared = await state.engine.prepare_off_loop(call.prompt, **call.prepare_kwargs(), **tool_kwargs(state, call),
                                                       **model_kwargs(state, call),
                                                       clamp_max_tokens=not state.config.strict_max_tokens)
    except RequestError as exc:
        raise call.in_wire_terms(exc) from None
    return _closing_reasoning(state, call, prepared)


def _closing_reasoning(state: AppState, call: CompletionCall, prepared: Any) -> Any:
    """`prepared`, its forced call's grammar made to close the think span its prompt leaves open first.

    Without it, on a template that opens `<think>` in the generation prompt, the
    call would be written inside the span and read as reasoning (the generic
    format has no marker of its own to leave it by). Only the prompt says
    whether the span is open, so the grammar is rebuilt once it is known.
    """
    fmt = state.engine.output_format
    if not (call.chat and call.tools.forced and fmt.think_end is not None
            and fmt.initial_state(getattr(prepared, "prompt_ids", ())) == REASONING):
        return prepared
    closing = call.tools.constraint(fmt.tool_parser_kind,
                                    close_reasoning=lark_marker(fmt.think_end, fmt.think_end_ids))
    return attrs.evolve(prepared, params=attrs.evolve(prepared.params, constraint=closing))


def model_kwargs(state: AppState, call: CompletionCall) -> dict[str, Any]:
    """`model` for `Engine.prepare` when the body names something other than the base model (an adapter).

    The base model is the name this server reports (`--served-model-name` or the engine's id) or "default".
    """
    if call.model is None or call.model in (state.model_name(), DEFAULT_MODEL_ALIAS):
        return {}
    return {"model": call.model}


def tool_kwargs(state: AppState, call: CompletionCall) -> dict[str, Any]:
    """`tools` and the `tool_choice` constraint for `Engine.prepare`; none when the request uses no tools.

    A model without any tool format gets the tools all the same:
    `Engine.prepare` refuses them, naming `tools`. The generic format's
    grammar for "auto" yields to a `response_format` (the answer is held to
    that schema instead); a forced call cannot be combined with one.
    """
    if not call.tools.active:
        return {}
    kwargs: dict[str, Any] = {"tools": call.tools.template_tools()}
    fmt = state.engine.output_format
    constraint = call.tools.constraint(fmt.tool_parser_kind) if fmt.accepts_tools else None
    if constraint is not None and "constraint" in call.sampling:
        if call.tools.choice == "auto":
            return kwargs
        raise InvalidParameter("tool_choice", "a required or named tool_choice cannot be combined with "
                                              "response_format; drop one of them")
    if constraint is not None:
        kwargs["constraint"] = constraint
    return kwargs


async def _first_event(events: AsyncIterator[GenerationEvent], next_event: NextEvent,
                       request_log: RequestLog) -> GenerationEvent:
    """The first event; whatever ends the wait instead (an error, a cut, the client leaving) closes `events`."""
    try:
        first = await next_event()
    except BaseException as exc:
        outcome = (api_error(exc).code or "error") if isinstance(exc, Exception) else "cancelled"
        request_log.done(outcome)
        async with closing(events):  # ended already, unless the fault point raised after the event came
            raise
    request_log.saw(first)
    return first


async def _stream(first: GenerationEvent, events: AsyncIterator[GenerationEvent], next_event: NextEvent,
                  renderer: Renderer, router: OutputRouter, request_log: RequestLog, crashes: HandlerCrashes, *,
                  logprobs: bool, prompt_tokens: int, before_end: BeforeEnd = _nothing) -> AsyncIterator[bytes]:
    """One request's SSE frames: `first` (already taken from `events`), then the rest, until `Finished`.

    Each event's frames go out as one body chunk (one ASGI send, one socket
    write), the finish's with the closing frames; several tokens in one event
    are the session's doing (`actors/session.py`, `_coalesced`).

    A failure after the headers is the last event; an unexpected one (a crash
    of this handler) is also counted in `crashes`.

    Closing this generator early (the client went away: quart closes the body
    iterator, or cancels the task writing it) closes `events`, which cancels
    the request in the engine and frees its KV cache.

    `before_end` is awaited after the finish is rendered and before its frames are sent
    (`serve_completion`).
    """
    outcome = "cancelled"
    frames: list[bytes] = []  # not yet sent
    last: list[bytes] = []  # the finish's or the error's frames
    try:
        async with closing(events):
            frames = renderer.opening(prompt_tokens)
            item = first
            while not isinstance(item, Finished):
                if isinstance(item, PromptProgress):
                    frames.extend(renderer.keepalive(item.processed, item.total))
                elif isinstance(item, TextDelta):
                    pieces = router.feed(item.text, len(item.token_ids))
                    frames.extend(renderer.delta(pieces, item.logprobs if logprobs else None))
                if frames:  # one body chunk per event: one write, not one per frame
                    yield b"".join(frames)
                    frames = []
                item = await next_event()
                request_log.saw(item)
            outcome = item.finish_reason
            last = [*frames, *renderer.finish(router.finish(), _counted(item, router), router.num_tool_calls)]
            await before_end()  # before the end goes out (a failure is the stream's error instead)
    except Exception as exc:  # noqa: BLE001  (trio.Cancelled is a BaseException and passes through)
        error = _stream_failure(exc, renderer.id)
        if error.code == INTERNAL_ERROR:
            crashes.record(exc)
        outcome = error.code or error.type
        last = [*frames, *renderer.error(error)]
    finally:
        request_log.done(outcome)
    yield b"".join([*last, *renderer.closing()])


# `_next` of one request's engine stream, as `_serve` binds it.
NextEvent = Callable[[], Awaitable[GenerationEvent]]


async def _next(drain: Drain, faults: Faults, events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
    """The next event, through the drain (a cut: 503 `shutdown`) and the "http" fault point (a crash).

    Called directly, not as generators wrapping the engine stream: each layer
    was an extra hop per streamed event on the Trio thread.
    """
    try:
        event = await drain.next_event(events)
    except StopAsyncIteration:  # an engine stream always ends with Finished or an error
        raise ActorCrashed("the generation ended without a finish event") from None
    handler_fault_point(faults)
    return event


def _stream_failure(exc: Exception, stream_id: str) -> ApiError:
    """What a stream that already started sends as its last event; server-side failures are logged."""
    error = api_error(exc)
    if error.status >= 500:
        log.warning("stream %s failed: %r", stream_id, exc)
    return error


def _counted(finished: Finished, router: OutputRouter) -> Finished:
    """`finished` with the reasoning tokens the router counted (the engine does not split its text)."""
    return attrs.evolve(finished, usage=attrs.evolve(finished.usage, reasoning_tokens=router.reasoning_tokens))


async def _collect(events: AsyncIterator[GenerationEvent], next_event: NextEvent,
                   request_log: RequestLog) -> tuple[list[TextDelta], Finished]:
    """A whole non-streamed generation: its text deltas and its `Finished`; logs the outcome."""
    deltas: list[TextDelta] = []
    outcome = "cancelled"
    try:
        async with closing(events):
            while True:
                event = await next_event()
                request_log.saw(event)
                if isinstance(event, TextDelta):
                    deltas.append(event)
                elif isinstance(event, Finished):
                    outcome = event.finish_reason
                    return deltas, event
    except Exception as exc:
        error = api_error(exc)
        outcome = error.code or error.type
        raise
    finally:
        request_log.done(outcome)
