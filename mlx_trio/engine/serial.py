"""One request's generation on the serial path, cut into lease-sized jobs.

This is mlx-lm's `generate_step` taken apart: the same chunked prefill of all
but the last prompt token, the same `_step` (model call, logits processors
over prompt + generated tokens, log-softmax, sampler), the same one-step
pipelining with `mx.async_eval`. Only the control flow differs: each method
is one job on the GPU lease, so the Trio side can interleave other work (and
notice a cancelled client) between chunks and tokens. Because the graph is the
same, the token ids are mlx-lm's token ids, which the goldens check.

A constrained request (a grammar) reads each token before queueing the
next step, whose mask depends on it; logprobs, when asked for, are gathered
in the same graph as the token (engine/sampling/token_logprobs.py).

Every method must run on the lease thread: the arrays held between calls are
lazy or `async_eval`'d and belong to that thread's stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.batch.chunked_prefill import ChunkedPrefill
from mlx_trio.engine.sampling.grammar import GrammarMatcher
from mlx_trio.engine.sampling.processors import build_logits_processors, build_sampler, processed_logprobs
from mlx_trio.engine.sampling.token_logprobs import LogprobArrays, arrays_of, gather_logprobs, to_record
from mlx_trio.logprobs import SampledLogprobs
from mlx_trio.params import SamplingParams

DEFAULT_PREFILL_STEP_SIZE = 2048
# mlx-lm frees the allocator's cache every 256 decoded tokens; so do we.
_CLEAR_CACHE_EVERY = 256


class SerialGeneration:
    """The KV cache and pipeline state of one request.

    Lifecycle (one lease job each): `prefill_chunk()` until it returns 0,
    then `step()` once per token until the caller stops asking, then
    `close()`. `step()` returns the token sampled one step earlier while the
    next step already runs on the device (mlx-lm's pipelining).
    """

    def __init__(
        self,
        model: nn.Module,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        rng_draws: int = 0,
        grammar_tokenizer: Any = None,
        resumed_tokens: int = 0,
    ) -> None:
        # `grammar_tokenizer` and `resumed_tokens` as for `SoloRow` (engine/batch/solo_row.py).
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        self._matcher = GrammarMatcher.for_row(params.constraint, grammar_tokenizer,
                                               prompt_ids[len(prompt_ids) - resumed_tokens:] if resumed_tokens else ())
        self._num_top: int | None = params.top_logprobs if params.wants_logprobs else None
        self._model = model
        self._cache = make_prompt_cache(model)
        self._sampler = build_sampler(params)
        self._processors = build_logits_processors(params)
        self._seed = params.seed
        self._rng_draws = rng_draws
        self._max_tokens = params.max_tokens
        self._prefill = ChunkedPrefill(model, self._cache, prompt_ids, prefill_step_size)
        self.num_prompt_tokens = len(prompt_ids)
        # Prompt + sampled tokens seen by the logits processors (mlx-lm's `tokens`).
        self._context: mx.array | None = None
        self._next: mx.array | None = None
        self._next_logprobs: LogprobArrays | None = None
        self.num_generated = 0

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens still to prefill before the first token can be sampled (excludes the last)."""
        return self._prefill.remaining

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._cache)

    def prefill_chunk(self) -> int:
        """Prefill up to `prefill_step_size` prompt tokens into the cache; returns how many remain.

        Mutates the KV cache in place. The last prompt token is never
        prefilled here: it is the input of the first sampling step.
        """
        chunk = self._prefill.chunk()
        if chunk is not None and self._processors:
            self._context = chunk if self._context is None else mx.concat([self._context, chunk])
        return self.prefill_remaining

    def step(self) -> int:
        """`step_decoded()`'s token id only."""
        return self.step_decoded()[0]

    def step_decoded(self) -> tuple[int, SampledLogprobs | None]:
        """Return the next token id (and its logprobs if asked for); queue the following step first (pipelined).

        The first call feeds the rest of the prompt (its last token). The
        caller decides when to stop; after `max_tokens` calls no further step
        is queued, so the device does no wasted work at the end.
        """
        if self._next is None:
            if self.prefill_remaining:
                raise RuntimeError("step() before the prompt was prefilled")
            if self._seed is not None:
                # mlx-lm samples from the global key, seeded per request.
                mx.random.seed(self._seed)
                for _ in range(self._rng_draws):
                    # Each random op takes one key from the global sequence, as each sample did.
                    mx.random.uniform(shape=(1,))
            self._next, self._next_logprobs = self._sample(self._prefill.take_rest())
            mx.async_eval(self._next, *arrays_of(self._next_logprobs))
        current, current_logprobs = self._next, self._next_logprobs
        self.num_generated += 1
        if self._matcher is not None:
            # The next step's mask depends on this token: read and consume it first.
            self._matcher.consume((current.item(),))
        if self.num_generated < self._max_tokens:
            self._next, self._next_logprobs = self._sample(current)
            # The context too: a processor that ignores it (logit_bias alone) would
            # otherwise leave an ever longer lazy concat chain behind.
            mx.async_eval(self._next, *([self._context] if self._context is not None else []),
                          *arrays_of(self._next_logprobs))
        token = current.item()
        record = to_record(current_logprobs) if current_logprobs is not None else None
        if self.num_generated % _CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return token, record

    def close(self) -> None:
        """Drop every array this request holds (in the lease thread, which owns them)."""
        self._cache = []
        self._prefill.release()
        self._context = None
        self._next = None
        self._next_logprobs = None

    def _sample(self, input_tokens: mx.array) -> tuple[mx.array, LogprobArrays | None]:
        logits = self._model(input_tokens[None], cache=self._cache)[:, -1, :]
        logprobs, self._context = processed_logprobs(logits, input_tokens, self._context, self._processors,
                                                     self._matcher)
        token = self._sampler(logprobs)
        if self._num_top is None:
            return token, None
        return token, gather_logprobs(logprobs, token, self._num_top)
