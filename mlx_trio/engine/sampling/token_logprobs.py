"""The sampled token's logprob and the top-k of its distribution, in the step's own graph.

A row that asks for logprobs adds three small arrays to its step: the
sampled token's logprob, and the ids and logprobs of its `k` most likely
tokens (argpartition, then a sort of those k only). They are evaluated with
the sampled tokens, so reading them costs no extra device round trip, and
rows that do not ask pay nothing. In a decode batch the rows that ask are
gathered together, one argpartition per distinct k (`gather_batch_logprobs`).
Runs on the lease thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import mlx.core as mx

from mlx_trio.logprobs import SampledLogprobs

_INF, _NEG_INF = math.inf, -math.inf

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


@attrs.frozen
class BatchLogprobs:
    """One step's logprobs for the rows of a batch that ask, gathered per distinct k (lazy until evaluated).

    `groups` holds, per k: the batch rows, their sampled tokens' logprobs `[n]`
    and their top ids and logprobs `[n, k]`, best first.
    """

    size: int
    groups: tuple[tuple[tuple[int, ...], mx.array, mx.array, mx.array], ...]

    def arrays(self) -> list[mx.array]:
        """What to hand `mx.eval`/`mx.async_eval`."""
        return [a for _, *arrays in self.groups for a in arrays]

    def keep(self, indices: Sequence[int]) -> BatchLogprobs:
        """The same logprobs for the rows that stay, renumbered as `indices` (old row numbers, in their new order)."""
        new = {old: i for i, old in enumerate(indices)}
        groups = tuple((tuple(new.get(r, -1) for r in rows), *arrays) for rows, *arrays in self.groups)
        return BatchLogprobs(len(indices), groups)  # type: ignore[arg-type]

    def records(self) -> tuple[SampledLogprobs | None, ...]:
        """Per row (batch order), plain values from the evaluated arrays; None for rows that did not ask."""
        out: list[SampledLogprobs | None] = [None] * self.size
        for rows, chosen, top_ids, top_values in self.groups:
            # `tolist()` gives Python ints and floats already: a row's top entries are zipped as they come,
            # filtered one by one only where the grammar forbade some (-inf), as `to_record` does.
            for row, c, ids, values in zip(rows, chosen.tolist(), top_ids.tolist(), top_values.tolist()):
                if row >= 0:
                    if _NEG_INF in values or _INF in values:
                        top = tuple((i, v) for i, v in zip(ids, values) if not math.isinf(v))
                    else:
                        top = tuple(zip(ids, values))
                    out[row] = SampledLogprobs(c, top)
        return tuple(out)


def gather_batch_logprobs(logprobs: mx.array, tokens: mx.array,
                          groups: Sequence[tuple[int, Sequence[int], mx.array]]) -> BatchLogprobs:
    """`gather_logprobs` for many rows: `logprobs` `[B, V]`, `tokens` `[B]`, `groups` of (k, rows wanting k,
    those rows as an index array: made once per row set, not once a step).

    Per k one argpartition over those rows: which of several tied logits
    argpartition keeps depends on k, so rows asking for different k never share one.
    """
    out = []
    for k, rows, take in groups:
        sub = logprobs[take]
        chosen = mx.take_along_axis(sub, tokens[take].astype(mx.int32)[:, None], axis=-1)[:, 0]
        k = min(k, sub.shape[-1])
        if k == 0:
            top_ids, top_values = mx.zeros((len(rows), 0), dtype=mx.int32), mx.zeros((len(rows), 0), dtype=sub.dtype)
        else:
            top_ids = mx.argpartition(-sub, kth=k - 1, axis=-1)[:, :k]
            top_values = mx.take_along_axis(sub, top_ids, axis=-1)
            order = mx.argsort(-top_values, axis=-1)
            top_ids, top_values = mx.take_along_axis(top_ids, order, axis=-1), mx.take_along_axis(top_values, order,
                                                                                                axis=-1)
        out.append((tuple(rows), chosen, top_ids, top_values))
    return BatchLogprobs(logprobs.shape[0], tuple(out))
