"""`MessageRenderer`: an Anthropic message on the shared completion path, streamed or whole.

The stream: `message_start`, `ping` (and one more per prefill progress
step: Anthropic's keep-alive), per content block `content_block_start`,
`content_block_delta`…, `content_block_stop` (`MessageBlocks` opens and
closes them as the router's pieces arrive), then `message_delta` (stop
reason, the final usage: cumulative, as Anthropic's) and `message_stop`; an
error after the headers is an `error` event. Each event is named by its
type. Logprobs are not part of this API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


from mlx_trio.events import Finished
from mlx_trio.http.anthropic.objects import MessageBlocks, MessageShape, stop_reason, usage_object
from mlx_trio.http.completion.output_router import Piece
from mlx_trio.http.server.errors import ApiError
from mlx_trio.http.server.sse import typed_events
from mlx_trio.logprobs import TokenLogprob


class MessageRenderer:
    """One message: its blocks so far (a stream's) and the shape every event shares."""

    kind = "messages"
    tool_call_prefix = "toolu_"

    def __init__(self, shape: MessageShape) -> None:
        self._shape = shape
        self._blocks = MessageBlocks()

    @property
    def id(self) -> str:
        return self._shape.id

    @property
    def created(self) -> int:
        return self._shape.created

    def opening(self, prompt_tokens: int) -> list[bytes]:
        return typed_events([self._shape.start_event(prompt_tokens), {"type": "ping"}])

    def keepalive(self, processed: int, total: int) -> list[bytes]:
        return typed_events([{"type": "ping"}])

    def delta(self, pieces: Sequence[Piece], logprobs: Sequence[TokenLogprob] | None) -> list[bytes]:
        return typed_events([e for piece in pieces for e in self._blocks.add(piece)])

    def finish(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int) -> list[bytes]:
        events = [e for piece in pieces for e in self._blocks.add(piece)] + self._blocks.close()
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": stop_reason(finished, tool_calls), "stop_sequence": finished.stop_sequence},
                       "usage": usage_object(finished.usage)})
        events.append({"type": "message_stop"})
        return typed_events(events)

    def error(self, error: ApiError) -> list[bytes]:
        return typed_events([error.anthropic_body()])

    def closing(self) -> list[bytes]:
        return []

    def whole(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int,
              logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        blocks = MessageBlocks()
        for piece in pieces:
            blocks.add(piece)
        return self._shape.message(blocks.blocks, stop_reason=stop_reason(finished, tool_calls),
                                   stop_sequence=finished.stop_sequence, usage=usage_object(finished.usage))
