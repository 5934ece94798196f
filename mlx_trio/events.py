"""What `Engine.generate` yields: frozen values, no MLX, no Trio.

A stream is zero or more `PromptProgress` (while the prompt is prefilled),
then zero or more `TextDelta`, then exactly one `Finished`. `Completion` is
the non-streaming summary of the same thing.
"""

from __future__ import annotations

import enum

import attrs

from mlx_trio.logprobs import TokenLogprob


class FinishReason(enum.StrEnum):
    """Why a generation ended. A `str` enum: it equals, prints and serialises as its wire value."""

    STOP = "stop"  # an EOS token or a stop string
    LENGTH = "length"  # max_tokens
    ERROR = "error"  # only between actors (`GenerationEnded`): a caller gets the exception instead


@attrs.frozen
class Usage:
    """Token counts as OpenAI reports them.

    `reasoning_tokens` (of `completion_tokens`) are those the model wrote in
    its reasoning span. The engine streams text without splitting it, so it
    always reports 0; the HTTP layer's output router, which splits the text,
    counts them (docs/api.md, "Reasoning").
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    # Speculative decoding (ours, not OpenAI's): proposals the target verified, and how many it accepted.
    speculative_proposed: int = 0
    speculative_accepted: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class PromptProgress:
    """`processed` of `total` prompt tokens are in the KV cache."""

    processed: int
    total: int


@attrs.frozen
class TextDelta:
    """New visible text and the token ids that produced it (text may lag ids by a token).

    `logprobs` is parallel to `token_ids` when the request asked for logprobs, else empty.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class CacheDivergence:
    """Where a prompt left the prompt-cache entry closest to it: why it missed, or hit short.

    `position` is the first prompt token that differs from that entry
    (`entry_tokens` long); `before` is the text of the few shared tokens just
    before it, `cached` and `prompt` the entry's and the prompt's text from
    there (docs/prompt-cache.md, "Why did my cache miss?").
    """

    position: int
    entry_tokens: int
    before: str
    cached: str
    prompt: str


@attrs.frozen
class Finished:
    """The last event: why generation stopped, and the counts."""

    finish_reason: FinishReason  # STOP or LENGTH
    usage: Usage
    # The stop string that ended the text (finish_reason "stop"); None for EOS or length.
    stop_sequence: str | None = None
    # Set when the prompt diverged from a close prompt-cache entry (at its last lookup).
    cache_divergence: CacheDivergence | None = None


GenerationEvent = PromptProgress | TextDelta | Finished


@attrs.frozen
class Completion:
    """A whole generation at once (`Engine.complete`)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
