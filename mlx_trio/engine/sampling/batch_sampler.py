"""Every row's sampling in one set of array operations over the batch: what `RowSampler` does per row.

A decode batch's rows each have their own options (logit_bias, penalties,
temperature, top-p/min-p/top-k, a seed, a grammar, logprobs). Sampling them
row by row costs Python and graph-building per row per step (a 2-token
`logit_bias` alone cost ~40 % of H200 throughput at B=64: docs/lab-notes/).
`BatchSampler` keeps each option as a per-row array, built when rows join or
leave, and applies each feature as one batched operation, only while some row
uses it; a row that does not use a feature gets its identity (a bias of 0, a
penalty window of no tokens, no filter, temperature 1).

Exactness: every row draws exactly the token its `RowSampler` draws alone
(tests/engine/sampling/test_batch_sampler.py checks it against solo rows over
random option mixes, float32 and bfloat16):

- Processors run in mlx-lm's order (`make_logits_processors`): logit_bias as
  a scatter-add of the row's `[k]` ids/values (padding adds 0 to token 0),
  then repetition, presence and frequency penalties over the row's window of
  its last `*_context_size` tokens (prompt included), read from a per-row
  history `[B, W]` kept on the device and shifted by each step's inputs. The
  repetition and presence penalties touch each windowed token once (mlx-lm
  assigns through a gather), so they apply under a presence mask; frequency
  is mlx-lm's own scatter-add of `-penalty` per occurrence, since repeated
  rounding in bfloat16 is not one multiply by the count.
- Scalars meet the logits in the logits' dtype, as a Python float does.
- Filters are mlx-lm's (`apply_top_p` with a per-row `top_p` array; min-p
  written out the same way with a per-row `log(min_p)`); top-k runs
  `apply_top_k` once per distinct `k` in the batch, because argpartition's
  choice among tied logits depends on k. Rows not using a filter keep their
  unfiltered logits (`where`).
- A draw is `mx.random.categorical` on a `[1, V]` row, which mlx computes
  by inverse CDF (one uniform from the row's key, a searchsorted on the
  exclusive cumsum of `exp(x - max)`); `_draw` writes that out per row, with
  each row's key split (vmapped) as the row alone splits it. The one
  difference is the reduction that sums a row: a row reduction here, an
  all-reduce for the row alone; they agree bit for bit on the CPU (the tests)
  and can differ in the last place on a GPU, which moves a draw only when
  the uniform lands within that of a token boundary.
- The grammar masks of the constrained rows fill one host `[B, V]` array,
  uploaded once per step.
- Logprobs are gathered per distinct `top_logprobs` k, for the same tie
  reason as top-k.

Runs on the lease thread: every array it returns is lazy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlx_trio.engine.sampling.grammar import GrammarMatcher
from mlx_trio.engine.sampling.row_sampler import RowSampler
from mlx_trio.engine.sampling.token_logprobs import BatchLogprobs, gather_batch_logprobs
from mlx_trio.params import SamplingParams

# History slots before a row's first token (never a token id).
_EMPTY = -1
# A stand-in key for greedy rows: split every step like the others, never drawn from.
_NO_KEY = (0, 0)

# Each row's key split, and one uniform from each row's key, as the row alone computes them. Compiled:
# `mx.vmap` traces its function at every call (a uniform cost 18 µs of the lease thread a step at B=64 on
# this CPU, 5 compiled); the compiled graph is traced once per batch size, with the same values.
_split_rows = mx.compile(mx.vmap(mx.random.split))
_uniform_rows = mx.compile(mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key)))


@attrs.frozen
class _Row:
    """What a row's sampling needs besides its device state (key, history): fixed while it is in the batch."""

    params: SamplingParams
    matcher: GrammarMatcher | None
    num_top: int | None
    # The tokens of history its penalties read: the largest enabled context size (0 without penalties).
    window: int

    @property
    def is_plain_greedy(self) -> bool:
        p = self.params
        return (p.is_greedy and self.matcher is None and self.num_top is None and not p.logit_bias
                and self.window == 0)


def _window(params: SamplingParams) -> int:
    sizes = [size for penalty, size in ((params.repetition_penalty, params.repetition_context_size),
                                        (params.presence_penalty, params.presence_context_size),
                                        (params.frequency_penalty, params.frequency_context_size)) if penalty]
    return max(sizes, default=0)


class BatchSampler:
    """The sampling state of a decode batch's rows, aligned with its batch axis.

    `join` appends rows (taking over each `RowSampler`'s key, token context and
    grammar after its token 0), `keep` drops the others, `sample` draws every
    row's next token, `accept` advances the grammars once the tokens are read.
    """

    def __init__(self) -> None:
        self._rows: list[_Row] = []
        # Per row, the key its next draw splits `[B, 2]` (the stand-in for greedy rows).
        self._keys: mx.array | None = None
        # Per row, its last `W` tokens (newest last, `_EMPTY` before its first) `[B, W]`; None while W == 0.
        self._history: mx.array | None = None
        # The per-row parameter arrays, built by the first `sample` after a join or leave.
        self._plan: _Plan | None = None
        # The constrained rows' (batch index, grammar), so a step's Python touches only those rows.
        self._matchers: list[tuple[int, GrammarMatcher]] = []

    @property
    def is_constrained(self) -> bool:
        """Some row has a grammar: its next mask needs the previous token read and `accept`ed first."""
        return bool(self._matchers)

    def join(self, samplers: Sequence[RowSampler], prompt_lengths: Sequence[int]) -> None:
        """Append one row per sampler, each after its token 0 (its key and context as they stand)."""
        rows = [_Row(s.params, s.matcher, s.params.top_logprobs if s.wants_logprobs else None, _window(s.params))
                for s in samplers]
        keys = mx.stack([s.key if s.key is not None else mx.array(_NO_KEY, dtype=mx.uint32) for s in samplers])
        self._keys = keys if self._keys is None else mx.concatenate([self._keys, keys])
        # A window longer than all the tokens a row can see reads all of them: cap it there.
        needed = [min(row.window, n + row.params.max_tokens) for row, n in zip(rows, prompt_lengths)]
        width = max([*needed, 0 if self._history is None else self._history.shape[1]])
        self._history = _widen(self._history, width, len(self._rows))
        if width:
            joined = mx.stack([_history_of(s, row.window, width) for s, row in zip(samplers, rows)])
            self._history = joined if self._history is None else mx.concatenate([self._history, joined])
        self._rows += rows
        self._changed()

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only these rows, in this order (the others left the batch)."""
        self._rows = [self._rows[i] for i in indices]
        if not self._rows:
            self.close()
            return
        take = mx.array(list(indices))
        assert self._keys is not None
        self._keys = self._keys[take]
        if self._history is not None:
            self._history = self._history[take]
        self._changed()

    def close(self) -> None:
        self._rows = []
        self._keys = None
        self._history = None
        self._changed()

    def _changed(self) -> None:
        """The row set changed: the parameter arrays are rebuilt by the next `sample`."""
        self._plan = None
        self._matchers = [(i, row.matcher) for i, row in enumerate(self._rows) if row.matcher is not None]

    def accept(self, tokens: Sequence[int]) -> None:
        """The tokens of the latest `sample`, read on the host (batch order): advance the grammars past them."""
        for i, matcher in self._matchers:
            matcher.consume((tokens[i],))

    def accept_runs(self, runs: Sequence[Sequence[int]]) -> None:
        """Each row's tokens emitted by one speculative step (batch order): advance the grammars past them."""
        for i, matcher in self._matchers:
            for token in runs[i]:  # one by one: a run may go on past the grammar's end (EOS), as steps do
                matcher.consume((token,))

    def allowed_proposals(self, proposals: Sequence[list[int]]) -> list[list[int]]:
        """`proposals` with each constrained row's cut before its first token the grammar forbids."""
        out = list(proposals)
        for i, matcher in self._matchers:
            out[i] = out[i][:matcher.valid_prefix(out[i])]
        return out

    def masks_along(self, proposals: Sequence[list[int]], vocab_size: int) -> list[mx.array] | None:
        """Per position of a speculative step `[B, V]` masks: each constrained row's grammar after its proposal so far.

        None without constrained rows. Positions past a row's proposal allow
        every token (their draws are never kept).
        """
        if not self._matchers:
            return None
        width = 1 + max(len(p) for p in proposals)
        masks = np.ones((width, len(self._rows), vocab_size), dtype=np.bool_)
        for i, matcher in self._matchers:
            for j, allowed in enumerate(matcher.allowed_along(proposals[i], vocab_size)):
                masks[j, i] = allowed
        return [mx.array(m) for m in masks]

    def checkpoint(self) -> tuple[mx.array | None, mx.array | None]:
        """Every row's device state (key, history) as of now, for `rewind`."""
        return self._keys, self._history

    def rewind(self, checkpoints: Sequence[tuple[mx.array | None, mx.array | None]], chosen: Sequence[int]) -> None:
        """Row `b` takes its state from `checkpoints[chosen[b]]` (a speculative step keeps only some draws).

        `sample` over a step's positions leaves a checkpoint after each; a
        row that emits `n` tokens keeps the state after its first `n` draws,
        so its key sequence and penalty history are those of plain decoding.
        """
        if all(c[0] is checkpoints[0][0] and c[1] is checkpoints[0][1] for c in checkpoints):
            return  # no draw changed any state (every row greedy without penalties)
        take = (mx.array(list(chosen)), mx.arange(len(chosen)))
        if self._keys is not None:
            self._keys = mx.stack([c[0] for c in checkpoints])[take]
        if self._history is not None:
            self._history = mx.stack([c[1] for c in checkpoints])[take]
        mx.async_eval(*(a for a in (self._keys, self._history) if a is not None))

    def sample(self, logits: mx.array, inputs: mx.array, *,
               mask: mx.array | None = None) -> tuple[mx.array, list[mx.array], BatchLogprobs | None]:
        """Every row's next token `[B]` from `logits` `[B, V]` of the forward that fed `inputs` `[B]`.

        Also returns the state arrays to evaluate with the tokens (so no graph
        grows across steps) and the logprobs of the rows that ask (None if none).
        `mask` `[B, V]` replaces the grammars' masks as they stand (a
        speculative step's later positions: `masks_along`).
        """
        if self._plan is None or self._plan.dtype != logits.dtype:
            width = 0 if self._history is None else self._history.shape[1]
            self._plan = _Plan.build(self._rows, logits.dtype, width)
        plan = self._plan
        state: list[mx.array] = []
        if plan.plain_greedy:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(logprobs, axis=-1), state, None
        if self._history is not None:
            self._history = mx.concatenate([self._history[:, 1:], inputs.astype(mx.int32)[:, None]], axis=1)
            state.append(self._history)
        logits = plan.process(logits, self._history)
        if plan.constrained:
            if mask is None:
                mask = _grammar_mask(self._matchers, len(self._rows), logits.shape[-1])
            logits = mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1)
        if plan.draws is not None:
            assert self._keys is not None
            split = _split_rows(self._keys)
            self._keys = split[:, 0]
            state.append(self._keys)
            tokens = plan.draws.tokens(logprobs, split[:, 1], tokens)
        batch_logprobs = gather_batch_logprobs(logprobs, tokens, plan.logprob_groups) if plan.logprob_groups else None
        return tokens, state, batch_logprobs


def _history_of(sampler: RowSampler, window: int, width: int) -> mx.array:
    """A joiner's history row `[width]`: the last `window` tokens of its context, right-aligned."""
    context = sampler.context
    tail = context[-min(window, context.shape[0]):].astype(mx.int32) if window and context is not None else None
    pad = width - (0 if tail is None else tail.shape[0])
    empty = mx.full((pad,), _EMPTY, dtype=mx.int32)
    return empty if tail is None else mx.concatenate([empty, tail])


def _widen(history: mx.array | None, width: int, num_rows: int) -> mx.array | None:
    """The running rows' history left-padded to `width` columns (None while nobody needs any)."""
    if width == 0:
        return None
    if history is None:
        return mx.full((num_rows, width), _EMPTY, dtype=mx.int32) if num_rows else None
    if history.shape[1] == width:
        return history
    return mx.concatenate([mx.full((num_rows, width - history.shape[1]), _EMPTY, dtype=mx.int32), history], axis=1)


def _column(values: Sequence[float], dtype: Any) -> mx.array:
    """`[B, 1]` per-row scalars in `dtype`: what a Python float becomes against an array of that dtype."""
    return mx.array(list(values), dtype=mx.float32).astype(dtype)[:, None]


@attrs.frozen
class _Plan:
    """The per-row parameter arrays of one row set; each feature is None while no row uses it."""

    dtype: Any
    plain_greedy: bool
    # `[B, 1]` each row's index, for scatters into its own row.
    row_ids: mx.array
    constrained: bool
    # logit_bias: `[B, k]` ids and float32 values (mlx-lm's dtype; the scatter casts them to the logits').
    bias: tuple[mx.array, mx.array] | None
    # Repetition / presence: (`[B, W]` which history slots the row's window reads, `[B, 1]` penalty).
    repetition: tuple[mx.array, mx.array] | None
    presence: tuple[mx.array, mx.array] | None
    # Frequency: (`[B, W]` window slots, `[B, W]` `-penalty` there and 0 elsewhere).
    frequency: tuple[mx.array, mx.array] | None
    # The rows that draw (the rest take the argmax); None when every row is greedy.
    draws: _Draws | None
    # Per distinct `top_logprobs` k: (k, the rows asking it, those rows as an index array).
    logprob_groups: tuple[tuple[int, tuple[int, ...], mx.array], ...]

    @classmethod
    def build(cls, rows: Sequence[_Row], dtype: Any, width: int) -> _Plan:
        params = [row.params for row in rows]
        n = len(rows)
        bias = None
        if any(p.logit_bias for p in params):
            k = max(len(p.logit_bias) for p in params)
            ids = [[t for t, _ in p.logit_bias] + [0] * (k - len(p.logit_bias)) for p in params]
            values = [[v for _, v in p.logit_bias] + [0.0] * (k - len(p.logit_bias)) for p in params]
            bias = (mx.array(ids, dtype=mx.int32), mx.array(values, dtype=mx.float32))
        ages = np.arange(width - 1, -1, -1)  # slot j holds the token fed `ages[j]` steps before the newest
        windows: list[tuple[np.ndarray, mx.array]] = []

        def window(penalty: str, size: str) -> tuple[mx.array, list[float]] | None:
            strengths = [getattr(p, penalty) for p in params]
            if not any(strengths):
                return None
            slots = np.stack([ages < (getattr(p, size) if s else 0) for p, s in zip(params, strengths)])
            # Penalties over the same windows share one array, so `process` masks them once a step.
            same = next((array for known, array in windows if np.array_equal(known, slots)), None)
            if same is None:
                same = mx.array(slots)
                windows.append((slots, same))
            return same, strengths

        repetition = window("repetition_penalty", "repetition_context_size")
        presence = window("presence_penalty", "presence_context_size")
        frequency = window("frequency_penalty", "frequency_context_size")
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            if row.num_top is not None:
                groups.setdefault(row.num_top, []).append(i)
        return cls(
            dtype=dtype,
            plain_greedy=all(row.is_plain_greedy for row in rows),
            row_ids=mx.arange(n)[:, None],
            constrained=any(row.matcher is not None for row in rows),
            bias=bias,
            repetition=None if repetition is None else (repetition[0], _column(
                [s if s else 1.0 for s in repetition[1]], dtype)),
            presence=None if presence is None else (presence[0], _column(presence[1], dtype)),
            frequency=None if frequency is None else (frequency[0], mx.where(
                frequency[0], _column([-s for s in frequency[1]], dtype), mx.array(0, dtype=dtype))),
            draws=_Draws.build([params[i] for i in sampled], sampled, n, dtype) if sampled else None,
            logprob_groups=tuple((k, tuple(idx), mx.array(idx)) for k, idx in sorted(groups.items())),
        )

    def process(self, logits: mx.array, history: mx.array | None) -> mx.array:
        """mlx-lm's logits processors, in its order, for every row at once (identity where a row has none)."""
        rows = self.row_ids
        if self.bias is not None:
            ids, values = self.bias
            logits = logits.at[rows, ids].add(values)
        if history is None:
            return logits
        vocab_size = logits.shape[-1]
        live = history >= 0  # not a slot before the row's first token
        # Penalties over one window (one slots array: see `build`) share its mask and the tokens seen there.
        windowed: dict[int, mx.array] = {}
        seen: dict[int, mx.array] = {}

        def window(slots: mx.array) -> mx.array:
            if id(slots) not in windowed:
                windowed[id(slots)] = slots & live
            return windowed[id(slots)]

        def seen_in(slots: mx.array) -> mx.array:
            if id(slots) not in seen:
                seen[id(slots)] = _seen(history, window(slots), vocab_size)
            return seen[id(slots)]

        if self.repetition is not None:
            slots, penalty = self.repetition
            logits = mx.where(seen_in(slots), mx.where(logits < 0, logits * penalty, logits / penalty), logits)
        if self.presence is not None:
            slots, penalty = self.presence
            logits = mx.where(seen_in(slots), logits - penalty, logits)
        if self.frequency is not None:
            slots, negated = self.frequency
            # One -penalty per occurrence, as mlx-lm's scatter-add; slots outside the window add 0 to token 0.
            logits = logits.at[rows, mx.where(window(slots), history, 0)].add(
                mx.where(live, negated, mx.array(0, dtype=negated.dtype)))
        return logits


@attrs.frozen
class _Draws:
    """The sampled (temperature > 0) rows of a batch and their filters, as arrays over those rows only.

    Filters and draws cost a sort or a scan per row, so greedy rows never pay for them.
    """

    # Their batch rows `[S]`, per batch row whether it draws and its place among them `[B]` (all None: every row).
    rows: mx.array | None
    sampled: mx.array | None
    place: mx.array | None
    inverse_temperature: mx.array
    # (`[S, 1]` rows using the filter, or None when all do; the per-row parameter `[S, 1]`).
    top_p: tuple[mx.array | None, mx.array] | None
    min_p: tuple[mx.array | None, mx.array] | None
    top_k: tuple[tuple[int, mx.array | None], ...]

    @classmethod
    def build(cls, params: Sequence[SamplingParams], rows: Sequence[int], batch_size: int, dtype: Any) -> _Draws:
        def used(flags: Sequence[bool]) -> mx.array | None:
            return None if all(flags) else mx.array(list(flags))[:, None]

        top_p = [0 < p.top_p < 1.0 for p in params]
        min_p = [p.min_p != 0.0 for p in params]
        every = len(rows) == batch_size
        place = [0] * batch_size
        for i, row in enumerate(rows):
            place[row] = i
        return cls(
            rows=None if every else mx.array(list(rows)),
            sampled=None if every else mx.array([i in set(rows) for i in range(batch_size)]),
            place=None if every else mx.array(place),
            inverse_temperature=_column([1.0 / p.temperature for p in params], dtype),
            top_p=(used(top_p), mx.array([p.top_p if u else 1.0 for p, u in zip(params, top_p)],
                                         dtype=mx.float32)[:, None]) if any(top_p) else None,
            min_p=(used(min_p), _column([math.log(p.min_p) if u else 0.0 for p, u in zip(params, min_p)], dtype))
            if any(min_p) else None,
            top_k=tuple((k, used([p.top_k == k for p in params]))
                        for k in sorted({p.top_k for p in params if p.top_k > 0})),
        )

    def tokens(self, logprobs: mx.array, keys: mx.array, greedy: mx.array) -> mx.array:
        """`greedy` `[B]` with each sampled row's own draw (its key of `keys` `[B, 2]`) in its place."""
        if self.rows is not None:
            logprobs, keys = logprobs[self.rows], keys[self.rows]
        if self.top_p is not None:
            logprobs = _where(self.top_p[0], apply_top_p(logprobs, self.top_p[1]), logprobs)
        if self.min_p is not None:
            logprobs = _where(self.min_p[0], _apply_min_p(logprobs, self.min_p[1]), logprobs)
        for k, rows in self.top_k:
            logprobs = _where(rows, apply_top_k(logprobs, k), logprobs)
        drawn = _categorical_rows(logprobs * self.inverse_temperature, keys)
        if self.rows is None:
            return drawn
        assert self.sampled is not None and self.place is not None
        return mx.where(self.sampled, mx.take(drawn, self.place), greedy)


def _where(rows: mx.array | None, filtered: mx.array, unfiltered: mx.array) -> mx.array:
    """`filtered` for the rows that use a filter (all of them when `rows` is None), `unfiltered` elsewhere."""
    return filtered if rows is None else mx.where(rows, filtered, unfiltered)


def _grammar_mask(matchers: Sequence[tuple[int, GrammarMatcher]], batch_size: int, vocab_size: int) -> mx.array:
    """`[B, V]` bool: each constrained row's allowed tokens (host-filled), every token elsewhere; one upload."""
    mask = np.ones((batch_size, vocab_size), dtype=np.bool_)
    for i, matcher in matchers:
        matcher.allowed_on_host(vocab_size, out=mask[i])
    return mx.array(mask)


def _seen(history: mx.array, slots: mx.array, vocab_size: int) -> mx.array:
    """`[B, V]` bool: the tokens in each row's `slots` of `history` (the others go to a spare column, then dropped)."""
    ids = mx.where(slots, history, vocab_size)
    seen = mx.zeros((history.shape[0], vocab_size + 1), dtype=mx.bool_)
    return mx.put_along_axis(seen, ids, mx.array(True), axis=-1)[:, :vocab_size]


@mx.compile
def _apply_min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    """mlx-lm's `apply_min_p` (min_tokens_to_keep=1) with a per-row `log(min_p)` `[B, 1]`."""
    scaled_min_p = mx.max(logprobs, axis=-1, keepdims=True) + log_min_p
    return mx.where(logprobs < scaled_min_p, -float("inf"), logprobs)


def _categorical_rows(logits: mx.array, keys: mx.array) -> mx.array:
    """Per row `b`, `mx.random.categorical(logits[b:b+1], key=keys[b])`: mlx's inverse-CDF path for one row."""
    x = logits.astype(mx.float32)  # mlx promotes to at least float32
    m = mx.max(x, axis=-1, keepdims=True)
    # exp(x - m) is NaN when m is infinite, where the distribution is uniform over the maximal entries.
    w = mx.where(mx.isinf(m), (x == m).astype(x.dtype), mx.exp(x - m))
    cdf = mx.cumsum(w, axis=-1, inclusive=False)
    u = _uniform_rows(keys) * mx.sum(w, axis=-1, keepdims=True)
    # searchsorted(cdf, u, "right") - 1 on a non-decreasing cdf: how many entries are <= u, less one.
    # Clipped: a row whose weights are NaN (a huge temperature times a filtered -inf) counts no entry,
    # and -1 as a token id would index past the embedding (MLX does not bounds-check: a segfault).
    return mx.clip((cdf <= u).sum(axis=-1) - 1, 0, x.shape[-1] - 1).astype(mx.uint32)
