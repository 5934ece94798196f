"""One row's sampling: mlx-lm's processors and sampler chain over the row's own context and key.

mlx-lm samples from the *global* `mx.random` state, so two seeded requests in
one batch would draw from one interleaved sequence (mlx_lm.server drains the
batch for a seeded request instead). A `RowSampler` holds its own key and
does per draw what the global key sequence does after `mx.random.seed(seed)`:
`key, sub = split(key)` and sample with `sub`. So a seeded row draws exactly
the tokens `stream_generate` draws for it alone, whatever else is batched
with it. Filters, order and temperature scaling are `make_sampler`'s, and
the logits processors are `make_logits_processors`' (via engine/sampling/processors.py).

A row may also be constrained (a `GrammarMatcher` masks its logits before
sampling; `accept()` advances it once the token is read) and may ask for
logprobs (`last_logprobs` holds the lazy arrays of the latest draw).

A row samples its token 0 here; in the decode batch, `BatchSampler`
(engine/sampling/batch_sampler.py) takes over its key, context and grammar and
draws the same tokens for all rows at once.

Runs on the lease thread: the arrays it returns are lazy.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlx_trio.engine.sampling.grammar import GrammarMatcher
from mlx_trio.engine.sampling.processors import build_logits_processors, processed_logprobs
from mlx_trio.engine.sampling.token_logprobs import LogprobArrays, gather_logprobs
from mlx_trio.params import SamplingParams

_Filter = Callable[[mx.array], mx.array]


class RowSampler:
    """Samples one row's next token from its logits, as mlx-lm's `generate_step` would.

    `prompt_ids` is the row's whole prompt. Its last token is the input of
    the first sampling step (mlx-lm's convention), so the processors' context
    starts as all but that token and `sample()` appends each step's input,
    exactly as `generate_step` builds its `tokens`.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], *, rng_draws: int = 0,
                 matcher: GrammarMatcher | None = None) -> None:
        # `rng_draws`: samples a resumed request already drew; skipping them continues its key sequence.
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        self.params = params
        self._matcher = matcher
        self._num_top: int | None = params.top_logprobs if params.wants_logprobs else None
        # The logprob arrays of the latest `sample()` (lazy), when the row asks for logprobs.
        self.last_logprobs: LogprobArrays | None = None
        self._processors = build_logits_processors(params)
        self._temperature = params.temperature
        self._filters = _filter_chain(params)
        self._key: mx.array | None = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self._key = mx.random.key(seed)
            for _ in range(rng_draws):
                self._key, _ = mx.random.split(self._key)
        # Invariant: _context is the row's tokens fed before the next `sample()`'s input
        # (None while there are none); kept only when a processor reads it.
        self._context: mx.array | None = None
        if self._processors and len(prompt_ids) > 1:
            self._context = mx.array(list(prompt_ids[:-1]))

    @property
    def is_plain_greedy(self) -> bool:
        """Temperature 0, no processors, no grammar, no logprobs: the batch may argmax this row with the others."""
        return self._key is None and not self._processors and self._matcher is None and self._num_top is None

    @property
    def is_constrained(self) -> bool:
        """A grammar masks this row: its next draw needs its previous token read and `accept`ed first."""
        return self._matcher is not None

    @property
    def wants_logprobs(self) -> bool:
        return self._num_top is not None

    def accept(self, token: int) -> None:
        """`token`, drawn by the latest `sample()`, was read on the host: advance the grammar past it."""
        if self._matcher is not None:
            self._matcher.consume((token,))

    @property
    def matcher(self) -> GrammarMatcher | None:
        return self._matcher

    @property
    def key(self) -> mx.array | None:
        """The key the next draw splits (None for a greedy row); a batch takes it over at join."""
        return self._key

    @property
    def context(self) -> mx.array | None:
        """The processors' token context (lazy); evaluate it with the sampled tokens so its graph never grows."""
        return self._context

    def sample(self, logits: mx.array, input_tokens: mx.array) -> mx.array:
        """The next token `[1]` (lazy) from this row's `logits` `[1, V]`.

        `input_tokens` are the tokens the forward that produced `logits` fed
        (the last prompt token, then each previous sample); they join the
        processors' context first. Advances the row's key when sampling.
        """
        logprobs, self._context = processed_logprobs(logits, input_tokens, self._context, self._processors,
                                                     self._matcher)
        token = self._draw(logprobs)
        if self._num_top is not None:
            # From the processed distribution, before temperature and filters (mlx-lm's logprobs).
            self.last_logprobs = gather_logprobs(logprobs, token, self._num_top)
        return token

    def _draw(self, logprobs: mx.array) -> mx.array:
        if self._key is None:
            return mx.argmax(logprobs, axis=-1)
        for apply_filter in self._filters:
            logprobs = apply_filter(logprobs)
        # The global key sequence's `next()`: keep the first half, draw with the second.
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self._temperature), key=sub)


def _filter_chain(params: SamplingParams) -> list[_Filter]:
    """`make_sampler`'s filters, in its order (top_p, min_p, top_k); xtc is not a request field."""
    filters: list[_Filter] = []
    if 0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    return filters
