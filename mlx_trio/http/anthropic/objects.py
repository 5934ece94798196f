"""Anthropic message objects and stream events, built from the router's pieces.

`MessageBlocks` turns pieces into content blocks (thinking, text, tool_use)
in the order the model wrote them; for a stream it also returns the
`content_block_start` / `_delta` / `_stop` events as blocks open and close,
so the streamed and the whole message are the same blocks. `MessageShape`
holds what the message and its events share (id, model).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import attrs

from mlx_trio.events import Finished, Usage
from mlx_trio.http.completion.cut_calls import partial_json
from mlx_trio.http.completion.output_router import Content, Piece, Reasoning, ToolCallMade

Event = dict[str, Any]
# The block type of each piece, and the delta field its text goes in.
_TEXT_BLOCKS = {Content: ("text", "text_delta", "text"), Reasoning: ("thinking", "thinking_delta", "thinking")}


def stop_reason(finished: Finished, num_tool_calls: int) -> str:
    """Anthropic's `stop_reason` for the engine's finish."""
    if finished.finish_reason == "length":
        return "max_tokens"
    if num_tool_calls:
        return "tool_use"
    return "stop_sequence" if finished.stop_sequence is not None else "end_turn"


def usage_object(usage: Usage) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the prompt cache.

    The prompt is `input_tokens + cache_read_input_tokens` (harnesses add the
    two to know how full the context is); nothing is billed for writing the
    cache, so `cache_creation_input_tokens` is 0.
    """
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


@attrs.frozen
class MessageShape:
    """The fields shared by a message and all its stream events."""

    model: str
    id: str
    created: int

    @classmethod
    def new(cls, *, model: str) -> MessageShape:
        return cls(model=model, id=f"msg_{uuid.uuid4().hex}", created=int(time.time()))

    def message(self, content: list[dict[str, Any]], *, stop_reason: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def start_event(self, prompt_tokens: int) -> Event:
        """`message_start`: how much of the prompt the cache held is not known yet (`message_delta` says)."""
        usage = usage_object(Usage(prompt_tokens, 0))
        return {"type": "message_start", "message": self.message([], stop_reason=None, stop_sequence=None,
                                                                 usage=usage)}


class MessageBlocks:
    """The content blocks of one answer, in order; `add` and `close` return the stream events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        # Invariant: the last block is still open (takes more text) while this is True.
        self._open = False

    def add(self, piece: Piece) -> list[Event]:
        if isinstance(piece, ToolCallMade):
            call = piece.call
            events = self.close()
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            events.append(self._start(block))
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            # A cut call (max_tokens): its input is what the SDK's stream reader makes of the same text.
            block["input"] = partial_json(call.arguments) if not call.complete or not call.arguments.strip() \
                else json.loads(call.arguments)
            events.extend(self.close(force=True))
            return events
        kind, delta_type, field = _TEXT_BLOCKS[type(piece)]
        events = []
        if not (self._open and self.blocks[-1]["type"] == kind):
            events = self.close()
            events.append(self._start({"type": kind, field: "", **({"signature": ""} if kind == "thinking" else {})}))
        self.blocks[-1][field] += piece.text
        events.append(self._delta({"type": delta_type, field: piece.text}))
        return events

    def close(self, *, force: bool = False) -> list[Event]:
        """Close the open block, if any (`force`: the one just started, a tool_use)."""
        if not (self._open or force):
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _start(self, block: dict[str, Any]) -> Event:
        self.blocks.append(block)
        self._open = block["type"] != "tool_use"
        return {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
