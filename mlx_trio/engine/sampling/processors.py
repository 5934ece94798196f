"""Turn `SamplingParams` into mlx-lm's logits processors, and apply them as `generate_step` does.

We reuse mlx-lm's own `make_logits_processors` so that our token choices
are mlx-lm's token choices (the goldens check it); this module only maps
our field names onto theirs. The sampler chain itself (filters, temperature,
the row's own key) is `RowSampler`'s (engine/sampling/row_sampler.py).
Runs on the lease thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from mlx_trio.params import SamplingParams

if TYPE_CHECKING:
    from mlx_trio.engine.sampling.grammar import GrammarMatcher

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """mlx-lm's logits processors; a penalty of 0 is skipped exactly as mlx-lm skips it."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty or None,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=params.frequency_context_size,
    )


def processed_logprobs(logits: mx.array, input_tokens: mx.array, context: mx.array | None,
                       processors: Sequence[LogitsProcessor],
                       matcher: GrammarMatcher | None) -> tuple[mx.array, mx.array | None]:
    """The distribution a row samples from, and its processors' context grown by `input_tokens`.

    mlx-lm's order (`generate_step`): the input tokens join the context, the
    logits processors run over it, then (ours) the grammar mask; the result
    is log-softmaxed. Logprobs are reported from this distribution, before
    temperature and the top-k/top-p/min-p filters. Lazy; lease thread.
    """
    if processors:
        context = input_tokens if context is None else mx.concatenate([context, input_tokens])
        for processor in processors:
            logits = processor(context, logits)
    if matcher is not None:
        logits = matcher.apply(logits)
    return logits - mx.logsumexp(logits, keepdims=True), context
