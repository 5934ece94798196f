"""Log-probabilities of sampled tokens: plain frozen values shared by every layer.

Two shapes. `SampledLogprobs` is what the engine measures for one sampled
token: ids and floats only, so it crosses from the GPU lease to the session
as plain data. `TokenLogprob` is what a caller sees: the session adds each
token's text and UTF-8 bytes (it holds the tokenizer), and the HTTP layer
writes it in OpenAI's shape.

Values are natural-log probabilities from the row's processed distribution
(after logits processors and the grammar mask, before temperature and the
top-k/top-p/min-p filters), i.e. mlx-lm's `generate_step` logprobs.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class SampledLogprobs:
    """One sampled token's logprob and the most likely tokens of its distribution.

    `top` is (token id, logprob) pairs, most likely first, at most the
    request's `top_logprobs`; tokens a grammar forbids (logprob -inf) are left
    out, so it may be shorter.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class TopLogprob:
    """One of the most likely tokens at a position."""

    token: str
    bytes: tuple[int, ...]
    logprob: float


@attrs.frozen
class TokenLogprob:
    """A sampled token as a caller sees it: its text and bytes, its logprob, the top alternatives."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()
