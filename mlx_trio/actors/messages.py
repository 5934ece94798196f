"""Messages between actors: frozen attrs values, never MLX arrays.

Commands are imperative (`Generate`), facts are past tense (`TokensDecoded`).
One request carries these names on its way through the lane:

    Request (validated, tokenized: `Engine.prepare`)
    └── Generate (one attempt at it, sent by the session; a resume sends another)
        └── JoinRow (its prefilled row, handed from prefill to decode-step)

A command carries at most a reply channel; who writes and who closes it is
documented on the field.
"""

from __future__ import annotations

from typing import TypeVar

import attrs
import trio

from mlx_trio.events import FinishReason
from mlx_trio.logprobs import SampledLogprobs
from mlx_trio.params import SamplingParams


@attrs.frozen
class Request:
    """A validated, tokenized request, ready for the engine (what the caller asked for, across every attempt)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    # The prompt's last message boundary in tokens (chats only): a prompt-cache snapshot point.
    snapshot_at: int | None = None
    # The adapter (a --lora-modules name) every forward of this request uses; None: the base model.
    adapter: str | None = None


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
    # Speculative proposals verified for this row in the steps behind these tokens, and those accepted.
    proposed: int = 0
    accepted: int = 0


@attrs.frozen
class GenerationEnded:
    """No more tokens will come for `request_id`.

    `reason` is STOP (an EOS token), LENGTH (max_tokens) or ERROR (then
    `error` holds the exception, already logged by the actor that sent it).
    `own` marks an error of this request alone (its own prefill failed), which
    counts against its resumes (`Engine.stream`); without it the error is the
    lane's (an actor failed under every request it held), which never does.
    """

    request_id: str
    reason: FinishReason
    error: BaseException | None = None
    own: bool = False


DecodeEvent = PrefillProgressed | TokensDecoded | GenerationEnded


@attrs.frozen
class Generate:
    """One attempt at a request: decode `prompt_ids` with `params`, report on `reply`.

    `reply` has one writer at a time: the lane actor that holds the request
    (admission while it queues, prefill until its row joins the batch,
    decode-step after), each handing it on with the request. Whichever ends
    the request closes `reply`, and only through `Lane.end_request`
    (actors/lane.py), which also releases its KV reservation. The session
    owns the receiving end and closes it to cancel: the holder notices at its
    next send and ends the request, freeing its KV cache. A reply closed
    without a `GenerationEnded` tells the session the lane failed under it.
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
    # The request's adapter (None: the base model); a resume keeps it.
    adapter: str | None = None


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
