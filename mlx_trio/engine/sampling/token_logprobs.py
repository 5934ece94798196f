"""The sampled token's logprob and the top-k of its distribution, in the step's own graph.

A row that asks for logprobs adds three small arrays to its step: the
sampled token's logprob, and the ids and logprobs of its `k` most likely
tokens (argpartition, then a sort of those k only). They are evaluated with
the sampled tokens, so reading them costs no extra device round trip, and
rows that do not ask pay nothing. Runs on the lease thread.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_trio.logprobs import SampledLogprobs

# (sampled token's logprob [1], top ids [k], top logprobs [k]): lazy until the step is evaluated.
LogprobArrays = tuple[mx.array, mx.array, mx.array]


def gather_logprobs(logprobs: mx.array, token: mx.array, k: int) -> LogprobArrays:
    """For one row: `logprobs` `[1, V]` (normalised), `token` `[1]` sampled from it, `k` top entries wanted."""
    row = logprobs[0]
    chosen = mx.take(row, token.astype(mx.int32))
    k = min(k, row.shape[0])
    if k == 0:
        return chosen, mx.zeros((0,), dtype=mx.int32), mx.zeros((0,), dtype=row.dtype)
    top_ids = mx.argpartition(-row, kth=k - 1)[:k]
    top_values = mx.take(row, top_ids)
    order = mx.argsort(-top_values)
    return chosen, mx.take(top_ids, order), mx.take(top_values, order)


def to_record(arrays: LogprobArrays) -> SampledLogprobs:
    """Plain values from evaluated arrays; tokens a grammar forbids (-inf) are left out of `top`."""
    chosen, top_ids, top_values = arrays
    top = tuple((int(i), float(v)) for i, v in zip(top_ids.tolist(), top_values.tolist()) if not math.isinf(v))
    return SampledLogprobs(float(chosen.item()), top)


def arrays_of(arrays: LogprobArrays | None) -> list[mx.array]:
    """What to hand `mx.eval`/`mx.async_eval` for `arrays` (nothing for None)."""
    return list(arrays) if arrays is not None else []
