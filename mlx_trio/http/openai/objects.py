"""OpenAI response objects and stream chunks for chat and text completions.

One `ResponseShape` per request holds what every chunk repeats (id, created,
model) so a stream's chunks all agree. Builders return plain dicts; which
chunks a stream sends, framed as SSE, is `render.py`'s job.
"""

from __future__ import annotations

import platform
import time
import uuid
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import attrs

import mlx_trio
from mlx_trio.events import Usage
from mlx_trio.http.completion.output_router import Content, Piece, Reasoning, ToolCall, ToolCallMade
from mlx_trio.http.openai.logprobs import chat_logprobs, text_logprobs
from mlx_trio.logprobs import TokenLogprob


def _version(dist: str) -> str:
    # Package metadata, not imports: this layer never imports MLX.
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


# Like mlx_lm.server's: changes whenever the code that produced the tokens changes.
SYSTEM_FINGERPRINT = (
    f"mlx-trio-{mlx_trio.__version__}-mlx-{_version('mlx')}-mlx-lm-{_version('mlx-lm')}-{platform.machine()}"
)


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


@attrs.frozen
class ResponseShape:
    """The fields shared by a response and all its chunks."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, *, chat: bool, model: str) -> ResponseShape:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat=chat, model=model, id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()))

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def logprobs(self, items: Sequence[TokenLogprob] | None, *, text_offset: int = 0) -> dict[str, Any] | None:
        """The choice's `logprobs` (None when the request did not ask for them)."""
        if items is None:
            return None
        return chat_logprobs(items) if self.chat else text_logprobs(items, text_offset=text_offset)

    def complete(self, text: str, finish_reason: str, usage: Usage, *, reasoning: str = "",
                 tool_calls: tuple[ToolCall, ...] = (),
                 logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        """The whole non-streamed response; `logprobs` are every visible token's, when asked for.

        A chat message that only calls tools has `content` null (as OpenAI's);
        `reasoning` and `tool_calls` appear only when there are some.
        """
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None}
            if reasoning:
                message["reasoning"] = reasoning
            if tool_calls:
                message["tool_calls"] = [_tool_call(call) for call in tool_calls]
            choice = {"index": 0, "message": message, "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish_reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage_object(usage)}

    def chunk(self, text: str, *, first: bool = False, finish_reason: str | None = None,
              logprobs: Sequence[TokenLogprob] | None = None, text_offset: int = 0) -> dict[str, Any]:
        """One stream chunk. The chat role is sent in the first delta only (OpenAI's framing).

        `logprobs` are this chunk's tokens' (None when not asked for);
        `text_offset` is where they start, for the text completions shape.
        """
        shaped = self.logprobs(logprobs, text_offset=text_offset)
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text or first:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": shaped, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": shaped, "finish_reason": finish_reason}
        return {**self._head(self._chunk_object), "choices": [choice]}

    def piece_chunks(self, piece: Piece) -> list[dict[str, Any]]:
        """Chat stream chunks for one routed piece.

        A tool call is two chunks, as OpenAI streams them: its index, id, type
        and name with empty arguments, then the arguments (one fragment: a
        call is parsed whole, so it is sent whole).
        """
        if isinstance(piece, Content):
            deltas: list[dict[str, Any]] = [{"content": piece.text}]
        elif isinstance(piece, Reasoning):
            deltas = [{"reasoning": piece.text}]
        else:
            call = piece.call
            deltas = [
                {"tool_calls": [{"index": piece.index, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]},
                {"tool_calls": [{"index": piece.index, "function": {"arguments": call.arguments}}]},
            ]
        return [{**self._head(self._chunk_object),
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
                for delta in deltas]

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The extra last chunk for `stream_options.include_usage`: no choices, only usage.

        Its object is the chunk object (mlx_lm.server sends "chat.completion"
        here, even for text completions; OpenAI sends the chunk object).
        """
        return {**self._head(self._chunk_object), "choices": [], "usage": usage_object(usage)}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def gather(pieces: list[Piece]) -> tuple[str, str, tuple[ToolCall, ...]]:
    """(content, reasoning, tool calls) of a whole non-streamed answer."""
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    return content, reasoning, tuple(p.call for p in pieces if isinstance(p, ToolCallMade))
