"""Messages between actors: frozen attrs values, never MLX arrays.

Commands are imperative (`Generate`), facts are past tense (`TokensDecoded`).
A command carries at most a reply channel, owned (and closed) by its sender's
peer as documented on the field.
"""

from __future__ import annotations

from typing import TypeVar

import attrs
import trio

from mlx_trio.logprobs import SampledLogprobs
from mlx_trio.params import SamplingParams


@attrs.frozen
class PrefillProgressed:
    """`processed` of `total` prompt tokens of `request_id` are in its KV cache."""

    request_id: str
    processed: int
    total: int
    cached_tokens: int = 0  # of `processed`, how many came from the prompt cache


@attrs.frozen
class TokensDecoded:
    """New token ids of `request_id`, in order; with their logprobs when the request asks for them."""

    request_id: str
    token_ids: tuple[int, ...]
    # Parallel to token_ids, or None when the request does not ask for logprobs.
    logprobs: tuple[SampledLogprobs, ...] | None = None


@attrs.frozen
class GenerationEnded:
    """No more tokens will come for `request_id`.

    `reason` is "stop" (an EOS token), "length" (max_tokens) or "error"
    (then `error` holds the exception, already logged by the decoder).
    """

    request_id: str
    reason: str
    error: BaseException | None = None


DecodeEvent = PrefillProgressed | TokensDecoded | GenerationEnded


@attrs.frozen
class Generate:
    """Decode `prompt_ids` with `params`; report on `reply`.

    The decoder closes `reply` when the request ends. The session closes its
    receiving end to cancel: the decoder notices at the next token and frees
    the request's KV cache.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    reply: trio.MemorySendChannel[DecodeEvent] = attrs.field(eq=False, repr=False)
    # Random draws a resumed request already made: a seeded row skips them, so its
    # sampling continues exactly where the interrupted run stood.
    rng_draws: int = 0
    # The prompt's last message boundary (tokens), where prefill stores a prompt-cache snapshot.
    snapshot_at: int | None = None
    # How many tokens at the end of prompt_ids this request generated before a resume:
    # a constrained request's grammar consumes them, so it continues where it stood.
    resumed_tokens: int = 0


@attrs.frozen
class Admitted:
    """Admission let `request` in, holding `reserved_bytes` of the KV budget until it is released."""

    request: Generate
    reserved_bytes: int


@attrs.frozen
class JoinRow:
    """A prefilled row, ready to join the running batch.

    `row` is an opaque engine handle (a SoloRow whose arrays live on the lease
    thread); `token0` was already sent to the session.
    """

    request: Generate
    row: object = attrs.field(eq=False, repr=False)
    token0: int


T = TypeVar("T")


def drain_nowait(channel: trio.MemoryReceiveChannel[T]) -> list[T]:
    """Everything buffered in `channel` right now, without waiting (empty once it is closed)."""
    items: list[T] = []
    while True:
        try:
            items.append(channel.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return items


def close_replies(pending: trio.MemoryReceiveChannel[T]) -> list[T]:
    """Close the reply channel of every command still queued in `pending`; return those commands.

    An actor that exits (crash or stop) must not leave sessions waiting on
    replies that will never come: a closed reply tells the session at once.
    """
    items = drain_nowait(pending)
    for item in items:
        request = item if isinstance(item, Generate) else item.request  # type: ignore[attr-defined]
        request.reply.close()
    return items
