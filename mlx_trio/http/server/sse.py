"""Server-sent events: an engine event stream → OpenAI-framed SSE bytes.

Framing (OpenAI's, which the `openai` SDK parses): `data: <json>\\n\\n` per
chunk; the first chunk carries the chat role; `PromptProgress` becomes an SSE
comment (`: keepalive processed/total`), which clients ignore but which keeps
proxies and idle timeouts from closing a long prefill; the last content chunk
carries `finish_reason`; a request that asked for logprobs gets each
token's in the chunk that carries it (a chunk may carry logprobs for
tokens whose text is still held back); an optional usage chunk follows; `data: [DONE]` is
always the last event, even after an error, which is sent in-band as
`data: {"error": {...}}` because the headers (200) are already out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from mlx_trio.events import Finished, GenerationEvent, PromptProgress, TextDelta
from mlx_trio.http.server.errors import ApiError, api_error
from mlx_trio.http.openai.logprobs import text_length
from mlx_trio.http.server.metrics import RequestLog
from mlx_trio.http.completion.output_router import OutputRouter
from mlx_trio.http.openai.objects import ResponseShape
from mlx_trio.http.server.state import closing

log = logging.getLogger("mlx_trio.http")


def stream_failure(exc: Exception, stream_id: str) -> ApiError:
    """What a stream that already started sends as its last event; server-side failures are logged."""
    error = api_error(exc)
    if error.status >= 500:
        log.warning("stream %s failed: %r", stream_id, exc)
    return error


DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Cache-Control": "no-cache",
    # nginx and similar proxies buffer responses unless told not to.
    "X-Accel-Buffering": "no",
}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def comment(text: str) -> bytes:
    # A comment line must not contain a newline, or the rest would be parsed as fields.
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


async def sse_stream(first: GenerationEvent, events: AsyncIterator[GenerationEvent], shape: ResponseShape, *,
                     include_usage: bool, request_log: RequestLog, router: OutputRouter | None = None,
                     logprobs: bool = False) -> AsyncIterator[bytes]:
    """Frame one request's events as SSE: `first` (already taken from `events`), then the rest.

    With a `router` (chat), text goes out as content, reasoning and tool-call
    deltas; without one (text completions), as it came.

    Closing this generator early (the client went away: quart closes the body
    iterator, or cancels the task writing it) closes `events`, which cancels
    the request in the engine and frees its KV cache.
    """
    outcome = "cancelled"
    frames = _Frames(shape, include_usage=include_usage, logprobs=logprobs, router=router)
    try:
        async with closing(events):
            if shape.chat:
                yield event(shape.chunk("", first=True))
            for chunk in frames.of(first):
                yield chunk
            async for item in events:
                request_log.saw(item)
                for chunk in frames.of(item):
                    yield chunk
                if isinstance(item, Finished):
                    outcome = item.finish_reason
    except Exception as exc:  # noqa: BLE001  (trio.Cancelled is a BaseException and passes through)
        error = stream_failure(exc, shape.id)
        outcome = error.code or error.type
        yield event(error.body())
    finally:
        request_log.done(outcome)
    yield DONE


class _Frames:
    """One stream's events → SSE frames: text through the router (if any), logprobs with their text offset."""

    def __init__(self, shape: ResponseShape, *, include_usage: bool, logprobs: bool,
                 router: OutputRouter | None) -> None:
        self._shape = shape
        self._include_usage = include_usage
        self._logprobs = logprobs
        self._router = router
        self._text_offset = 0

    def of(self, item: GenerationEvent) -> list[bytes]:
        shape, router = self._shape, self._router
        if isinstance(item, PromptProgress):
            return [comment(f"keepalive {item.processed}/{item.total}")]
        if isinstance(item, TextDelta):
            frames: list[bytes] = []
            if router is not None:
                frames = [event(chunk) for piece in router.feed(item.text) for chunk in shape.piece_chunks(piece)]
                text = ""  # the router's chunks carry the text; logprobs go in a chunk of their own
            else:
                text = item.text
            if self._logprobs and item.logprobs:
                frames.append(event(shape.chunk(text, logprobs=item.logprobs, text_offset=self._text_offset)))
                self._text_offset += text_length(item.logprobs)
            elif text:
                frames.append(event(shape.chunk(text)))
            return frames
        frames = []
        finish_reason = item.finish_reason
        if router is not None:
            frames = [event(chunk) for piece in router.finish() for chunk in shape.piece_chunks(piece)]
            finish_reason = router.finish_reason(finish_reason)
        frames.append(event(shape.chunk("", finish_reason=finish_reason)))
        if self._include_usage:
            frames.append(event(shape.usage_chunk(item.usage)))
        return frames
