"""BatchSampler draws, for every row of a mixed batch, exactly the tokens its RowSampler draws alone.

Rows join and leave at random steps with random option mixes (greedy and
seeded, logit_bias, the three penalties with their windows, top-p/min-p/top-k,
logprobs); logits are fixed pseudo-random rows in float32 and bfloat16, so the
only thing shared between the batch and the solo runs is each row's own input.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_trio.engine.sampling.batch_sampler import BatchSampler
from mlx_trio.engine.sampling.row_sampler import RowSampler
from mlx_trio.logprobs import SampledLogprobs
from mlx_trio.params import SamplingParams

VOCAB = 48


def _logits(row: int, step: int, dtype: Any) -> mx.array:
    """Row `row`'s logits `[1, V]` at its `step`: spread, with a few exact ties so argpartition's choice matters."""
    x = mx.random.normal((1, VOCAB), key=mx.random.key(7919 * row + step)) * 3.0
    return mx.round(x * 4) / 4 if step % 3 == 0 else x.astype(dtype).astype(mx.float32)


@attrs.frozen
class Row:
    params: SamplingParams
    prompt: tuple[int, ...]
    join_at: int
    steps: int


def _solo(row: Row, index: int, dtype: Any) -> tuple[list[int], list[SampledLogprobs | None]]:
    """The row alone: token 0 then `steps` more, each fed back as the next input."""
    sampler = RowSampler(row.params, row.prompt)
    tokens, logprobs = [], []
    token = mx.array([row.prompt[-1]])
    for step in range(row.steps + 1):
        token = sampler.sample(_logits(index, step, dtype).astype(dtype), token)
        tokens.append(token.item())
        logprobs.append(_record(sampler))
        sampler.accept(tokens[-1])
    return tokens, logprobs


def _record(sampler: RowSampler) -> SampledLogprobs | None:
    from mlx_trio.engine.sampling.token_logprobs import to_record

    return to_record(sampler.last_logprobs) if sampler.last_logprobs is not None else None


def _batched(rows: list[Row], dtype: Any) -> dict[int, tuple[list[int], list[SampledLogprobs | None]]]:
    """The rows through one BatchSampler: each joins after its own token 0, leaves after its last step."""
    batch = BatchSampler()
    live: list[int] = []  # batch order -> row index
    step_of: dict[int, int] = {}
    out: dict[int, tuple[list[int], list[SampledLogprobs | None]]] = {i: ([], []) for i in range(len(rows))}
    last: dict[int, int] = {}
    for clock in range(max(r.join_at + r.steps for r in rows) + 2):
        leaving = [i for i in live if step_of[i] > rows[i].steps]
        if leaving:
            batch.keep([b for b, i in enumerate(live) if i not in leaving])
            live = [i for i in live if i not in leaving]
        joiners = [i for i, r in enumerate(rows) if r.join_at == clock]
        samplers = []
        for i in joiners:
            sampler = RowSampler(rows[i].params, rows[i].prompt)
            token0 = sampler.sample(_logits(i, 0, dtype).astype(dtype), mx.array([rows[i].prompt[-1]]))
            out[i][0].append(token0.item())
            out[i][1].append(_record(sampler))
            sampler.accept(out[i][0][-1])
            last[i] = out[i][0][-1]
            step_of[i] = 1
            samplers.append(sampler)
        if joiners:
            batch.join(samplers, [len(rows[i].prompt) for i in joiners])
            live += joiners
            new = [b for b, i in enumerate(live) if step_of[i] > rows[i].steps]
            if new:  # rows with no step after token 0 leave at once
                batch.keep([b for b in range(len(live)) if b not in new])
                live = [i for b, i in enumerate(live) if b not in new]
        if not live:
            continue
        logits = mx.concatenate([_logits(i, step_of[i], dtype) for i in live]).astype(dtype)
        inputs = mx.array([last[i] for i in live], dtype=mx.uint32)
        tokens, state, logprobs = batch.sample(logits, inputs)
        mx.eval(tokens, *state, *(logprobs.arrays() if logprobs else []))
        values = tokens.tolist()
        batch.accept(values)
        records = logprobs.records() if logprobs else (None,) * len(live)
        for i, token, record in zip(live, values, records):
            out[i][0].append(token)
            out[i][1].append(record)
            last[i] = token
            step_of[i] += 1
    return out


def _params(draw: st.DrawFn) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": 64}
    if draw(st.booleans()):
        kwargs |= {"temperature": draw(st.sampled_from([0.5, 0.8, 1.0, 1.7])), "seed": draw(st.integers(0, 2**40))}
        kwargs["top_p"] = draw(st.sampled_from([1.0, 1.0, 0.9, 0.6]))
        kwargs["min_p"] = draw(st.sampled_from([0.0, 0.0, 0.05, 0.2]))
        kwargs["top_k"] = draw(st.sampled_from([0, 0, 3, 8]))
    if draw(st.booleans()):
        kwargs["logit_bias"] = tuple(draw(st.dictionaries(st.integers(0, VOCAB - 1),
                                                          st.sampled_from([-100.0, -2.5, 1.3, 4.0]),
                                                          min_size=1, max_size=3)).items())
    for penalty, values in (("repetition_penalty", [1.1, 1.5, 0.7]), ("presence_penalty", [0.4, 1.5]),
                            ("frequency_penalty", [0.3, 1.1])):
        if draw(st.integers(0, 2)) == 0:
            kwargs[penalty] = draw(st.sampled_from(values))
            kwargs[penalty.replace("penalty", "context_size")] = draw(st.sampled_from([1, 3, 20, 1000]))
    if draw(st.integers(0, 2)) == 0:
        kwargs |= {"logprobs": True, "top_logprobs": draw(st.sampled_from([0, 2, 5]))}
    return SamplingParams(**kwargs)


@st.composite
def batches(draw: st.DrawFn) -> list[Row]:
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)))
        rows.append(Row(_params(draw), prompt, draw(st.integers(0, 4)), draw(st.integers(0, 10))))
    return rows


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@settings(max_examples=40, deadline=None)
@given(rows=batches())
def test_mixed_batch_rows_draw_their_solo_tokens(rows: list[Row], dtype: Any) -> None:
    """Tokens and logprobs of every row equal its solo RowSampler's, whatever shares the batch."""
    got = _batched(rows, dtype)
    for i, row in enumerate(rows):
        assert got[i] == _solo(row, i, dtype), (i, row)


def test_penalties_bias_and_seeds_change_the_draws() -> None:
    """The features really act in the batch (or the parity above could hold vacuously)."""
    plain = Row(SamplingParams(max_tokens=64), (1, 2, 3), 0, 12)
    busy = Row(SamplingParams(max_tokens=64, temperature=1.0, seed=3, repetition_penalty=2.0,
                              frequency_penalty=1.0, logit_bias=((5, 3.0),)), (1, 2, 3), 0, 12)
    got = _batched([plain, busy, attrs.evolve(busy, params=attrs.evolve(busy.params, seed=4))], mx.float32)
    assert got[0][0] != got[1][0] != got[2][0]
    assert got[1] == _solo(busy, 1, mx.float32)


def test_a_row_whose_weights_are_nan_still_draws_a_token_in_the_vocabulary() -> None:
    """A huge temperature scales a filtered -inf to NaN: the draw must stay a valid id, never -1 (an OOB gather)."""
    from mlx_trio.engine.sampling.batch_sampler import _categorical_rows  # noqa: PLC0415

    logits = mx.array([[float("nan")] * 7, [0.0, 1.0, 2.0, float("-inf"), 0.0, 0.0, 0.0]])
    keys = mx.stack([mx.random.key(1), mx.random.key(2)])
    drawn = _categorical_rows(logits, keys).tolist()
    assert all(0 <= token < 7 for token in drawn)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_penalties_over_one_window_share_it_and_keep_the_solo_tokens(dtype: Any) -> None:
    """Penalties whose windows are the same slots use one array (masked once a step); the draws stay the solo ones."""
    from mlx_trio.engine.sampling.batch_sampler import _Plan, _Row  # noqa: PLC0415

    same = SamplingParams(max_tokens=64, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=1.1,
                          repetition_context_size=3, presence_context_size=3, frequency_context_size=3)
    other = attrs.evolve(same, presence_context_size=20, temperature=0.8, seed=11)
    rows = [Row(same, (1, 2, 3, 2), 0, 12), Row(other, (4, 4, 5), 1, 10), Row(same, (7, 7), 2, 9)]
    got = _batched(rows, dtype)
    for i, row in enumerate(rows):
        assert got[i] == _solo(row, i, dtype), i

    plan = _Plan.build([_Row(same, None, None, 3)] * 2, dtype, 3)
    assert plan.repetition is not None and plan.presence is not None and plan.frequency is not None
    assert plan.repetition[0] is plan.presence[0] is plan.frequency[0]
    mixed = _Plan.build([_Row(same, None, None, 3), _Row(other, None, None, 20)], dtype, 20)
    assert mixed.repetition is not None and mixed.presence is not None
    assert mixed.repetition[0] is not mixed.presence[0]
