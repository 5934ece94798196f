"""`Renderer`: what a wire API adds to the shared completion path (`serve.py`): its shapes, nothing else.

The path owns everything that is the same for every wire API: `Engine.prepare`,
the output router, keep-alive comments, the request log, disconnects and
the drain. A renderer only says how one request's answer looks on its wire:

    streamed:  opening, (keepalive | delta)*, then finish or error, then closing
    whole:     whole (a non-streamed answer, as one JSON object)

Each call gets the router's pieces (content, reasoning, tool calls) and
returns the SSE frames to send (`server/sse.py` frames them), or the body.
One renderer serves one request, so it may keep state across a stream
(an id, block indices, a sequence number). Implementations:
`openai.render.CompletionRenderer` (chat and text completions) and
`anthropic.render.MessageRenderer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mlx_trio.events import Finished
from mlx_trio.http.completion.output_router import Piece
from mlx_trio.http.server.errors import ApiError
from mlx_trio.logprobs import TokenLogprob


class Renderer(Protocol):
    """One wire API's shapes for one request's answer.

    `id` is the response id, also the request log's, and `created` its time; `kind` names the
    endpoint in that log ("chat", "text", "messages"); parsed tool calls get
    ids starting with `tool_call_prefix`. `logprobs` are None when the
    request did not ask for them. `tool_calls` is how many calls the answer made.
    """

    @property
    def id(self) -> str: ...

    @property
    def created(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def tool_call_prefix(self) -> str: ...

    def opening(self, prompt_tokens: int) -> list[bytes]:
        """The frames before the first event (e.g. OpenAI's role chunk, Anthropic's `message_start`)."""
        ...

    def keepalive(self, processed: int, total: int) -> list[bytes]:
        """The frames for one `PromptProgress` (`processed` of `total` prompt tokens), so that proxies and
        idle timeouts do not close a stream during a long prefill (an SSE comment; Anthropic's `ping`)."""
        ...

    def delta(self, pieces: Sequence[Piece], logprobs: Sequence[TokenLogprob] | None) -> list[bytes]:
        """The frames for one `TextDelta`: its routed pieces (maybe none yet) and its tokens' logprobs."""
        ...

    def finish(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int) -> list[bytes]:
        """The last frames of an answer: the router's flushed pieces, then the finish (reason, usage)."""
        ...

    def error(self, error: ApiError) -> list[bytes]:
        """The in-band error of a stream that failed after its headers were sent."""
        ...

    def closing(self) -> list[bytes]:
        """The frames that end every stream that was not cancelled, after `finish` or `error` (OpenAI's `[DONE]`)."""
        ...

    def whole(self, pieces: Sequence[Piece], finished: Finished, tool_calls: int,
              logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        """The whole non-streamed answer, from all of its pieces."""
        ...
