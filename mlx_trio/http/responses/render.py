"""`ResponsesRenderer`: a Responses answer on the shared completion path (`completion/serve.py`), streamed or whole.

It frames `ResponseEvents`' events as SSE (`event: <type>` and `data:`,
no `[DONE]`: the stream ends with its terminal event) and, when a custom
tool with a grammar is forced, turns the whole answer into that tool's
call: the grammar shaped all of it, so there is no call syntax for the
router to find.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from mlx_trio.events import Finished
from mlx_trio.http.completion.output_router import Content, Piece, Reasoning, ToolCall, ToolCallMade
from mlx_trio.http.responses.events import ResponseEvents
from mlx_trio.http.server.errors import ApiError
from mlx_trio.http.server.sse import comment, typed_events
from mlx_trio.logprobs import TokenLogprob


class ResponsesRenderer:
    """One response; once it has finished (completed or incomplete), `events.response` is the finished one
    (the endpoint stores it before the last frame goes out: `serve_completion`'s `before_end`)."""

    kind = "responses"
    tool_call_prefix = "call_"

    def __init__(self, events: ResponseEvents, *, forced_tool: str | None = None) -> None:
        self._events = events
        self._forced_tool = forced_tool
        self._forced_input: list[str] = []

    @property
    def id(self) -> str:
        return self._events.shape.id

    @property
    def created(self) -> int:
        return self._events.shape.created_at

    def opening(self, prompt_tokens: int) -> list[bytes]:
        return typed_events(self._events.start())

    def keepalive(self, processed: int, total: int) -> list[bytes]:
        # The Responses stream has no keep-alive event (and every event needs a sequence number): a comment.
        return [comment(f"keepalive {processed}/{total}")]

    def delta(self, pieces: Sequence[Piece], logprobs: Sequence[TokenLogprob] | None) -> list[bytes]:
        return typed_events(self._events.pieces(self._forced(pieces), logprobs=logprobs or ()))

    def finish(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int) -> list[bytes]:
        return typed_events([*self._events.pieces(self._forced(pieces, last=True)), *self._events.finish(finished)])

    def error(self, error: ApiError) -> list[bytes]:
        return typed_events(self._events.fail(error))

    def closing(self) -> list[bytes]:
        return []

    def whole(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int,
              logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        return self._events.whole(self._forced(pieces, last=True), finished, logprobs=logprobs or ())

    def _forced(self, pieces: Sequence[Piece], *, last: bool = False) -> Sequence[Piece]:
        """With a forced custom tool, the text is held as its input and given as one call at the end."""
        if self._forced_tool is None:
            return pieces
        self._forced_input.extend(p.text for p in pieces if isinstance(p, (Content, Reasoning)))
        if not last:
            return []
        # Arguments as a template-rendered custom call carries them, so both read back the same way.
        arguments = json.dumps({"input": "".join(self._forced_input)}, ensure_ascii=False)
        return [ToolCallMade(0, ToolCall(f"call_{uuid.uuid4().hex[:24]}", self._forced_tool, arguments))]
