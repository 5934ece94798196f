"""`CompletionRenderer`: chat and text completions on the shared path, as OpenAI streams and answers them.

Stream framing (OpenAI's, which the `openai` SDK parses): `data: <json>\\n\\n`
per chunk; a chat stream's first chunk carries the role only; chat text
goes out as content, reasoning and tool-call deltas, text completions' as
it came; a request that asked for logprobs gets each token's in the chunk
that carries it (a chunk may carry logprobs for tokens whose text the router
still holds back); the last chunk carries `finish_reason`; an optional usage
chunk follows; `data: [DONE]` is always the last event, even after an error,
which is sent in-band as `data: {"error": {...}}` because the headers (200)
are already out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


from mlx_trio.events import Finished
from mlx_trio.http.completion.output_router import Content, Piece, Reasoning
from mlx_trio.http.openai.logprobs import text_length
from mlx_trio.http.openai.objects import ResponseShape, gather
from mlx_trio.http.server.errors import ApiError
from mlx_trio.http.server.sse import SLOT, StringTemplate, comment, event
from mlx_trio.logprobs import TokenLogprob

DONE = b"data: [DONE]\n\n"


def finish_reason(finished: Finished, tool_calls: int) -> str:
    """OpenAI's "tool_calls" when the model stopped after calling tools, else the engine's reason."""
    return "tool_calls" if finished.finish_reason == "stop" and tool_calls else finished.finish_reason


def _templates(shape: ResponseShape) -> dict[type, StringTemplate]:
    """A chat stream's content and reasoning chunks as templates; none if SLOT is in the shape (its model name)."""
    try:
        return {kind: StringTemplate(shape.piece_chunks(kind(SLOT))[0]) for kind in (Content, Reasoning)}
    except ValueError:
        return {}


class CompletionRenderer:
    """One chat or text completion (`shape.chat` says which); `include_usage` adds the usage chunk."""

    tool_call_prefix = "call_"

    def __init__(self, shape: ResponseShape, *, include_usage: bool) -> None:
        self._shape = shape
        self._include_usage = include_usage
        # Where the next chunk's logprobs start in the completion (the text completions shape counts it).
        self._text_offset = 0
        # Content and reasoning chunks, which only their text tells apart, as prebuilt bytes (chat only).
        self._templates = _templates(shape) if shape.chat else {}

    @property
    def id(self) -> str:
        return self._shape.id

    @property
    def created(self) -> int:
        return self._shape.created

    @property
    def kind(self) -> str:
        return "chat" if self._shape.chat else "text"

    def opening(self, prompt_tokens: int) -> list[bytes]:
        return [event(self._shape.chunk("", first=True))] if self._shape.chat else []

    def keepalive(self, processed: int, total: int) -> list[bytes]:
        return [comment(f"keepalive {processed}/{total}")]  # OpenAI has no keep-alive event; clients skip comments

    def delta(self, pieces: Sequence[Piece], logprobs: Sequence[TokenLogprob] | None) -> list[bytes]:
        shape = self._shape
        if shape.chat:
            frames = [self._piece(piece) for piece in pieces]
            text = ""  # the pieces' chunks carry the text; logprobs go in a chunk of their own
        else:
            frames = []
            text = "".join(p.text for p in pieces if isinstance(p, Content))
        if logprobs:
            frames.append(event(shape.chunk(text, logprobs=logprobs, text_offset=self._text_offset)))
            self._text_offset += text_length(logprobs)
        elif text:
            frames.append(event(shape.chunk(text)))
        return frames

    def _piece(self, piece: Piece) -> bytes:
        """The chat chunks of one piece, framed (`ResponseShape.piece_chunks`)."""
        template = self._templates.get(type(piece))
        if template is not None:
            return template.fill(piece.text)  # type: ignore[union-attr]
        return b"".join(event(chunk) for chunk in self._shape.piece_chunks(piece))

    def finish(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int) -> list[bytes]:
        frames = self.delta(pieces, None)
        frames.append(event(self._shape.chunk("", finish_reason=finish_reason(finished, tool_calls))))
        if self._include_usage:
            frames.append(event(self._shape.usage_chunk(finished.usage)))
        return frames

    def error(self, error: ApiError) -> list[bytes]:
        return [event(error.body())]

    def closing(self) -> list[bytes]:
        return [DONE]

    def whole(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int,
              logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        content, reasoning, calls = gather(list(pieces))
        return self._shape.complete(content, finish_reason(finished, tool_calls), finished.usage,
                                    reasoning=reasoning, tool_calls=calls, logprobs=logprobs)
