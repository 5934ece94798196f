"""RowSampler draws what mlx-lm's sampler draws, from its own key and its own token context."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_trio.engine.sampling.row_sampler import RowSampler
from mlx_trio.params import SamplingParams

VOCAB = 64
DRAWS = 20


def _logits(step: int, row: int = 0) -> mx.array:
    """Fixed pseudo-random logits `[1, V]`, spread enough that every filter bites and draws vary."""
    return mx.random.normal((1, VOCAB), key=mx.random.key(1000 * row + step)) * 2.0


def _mlx_lm_draws(params: SamplingParams, steps: range, row: int = 0) -> list[int]:
    """mlx-lm's own sampler after `mx.random.seed(seed)`, as mlx_lm.server seeds a request."""
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    mx.random.seed(params.seed)
    draws = []
    for step in steps:
        logits = _logits(step, row)
        draws.append(sampler(logits - mx.logsumexp(logits, keepdims=True)).item())
    return draws


SEEDED: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.8},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 0.9, "min_p": 0.1},
    {"temperature": 1.0, "top_p": 0.9, "min_p": 0.05, "top_k": 12},
]


@pytest.mark.parametrize("kwargs", SEEDED, ids=lambda k: "-".join(k))
def test_seeded_row_reproduces_mlx_lm_sampler(kwargs: dict[str, Any]) -> None:
    """With a seed, 20 draws equal mlx-lm make_sampler's under mx.random.seed, filter chain included."""
    params = SamplingParams(seed=1234, **kwargs)
    want = _mlx_lm_draws(params, range(DRAWS))
    sampler = RowSampler(params, [1, 2, 3])
    got = [sampler.sample(_logits(step), mx.array([3])).item() for step in range(DRAWS)]
    assert got == want
    assert len(set(got)) > 1  # the draws are random, not a degenerate argmax


def test_rows_with_different_seeds_interleaved_each_reproduce_their_solo_sequence() -> None:
    """Two seeded rows sampled alternately (a batch) still each draw their own solo sequence."""
    a = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    b = SamplingParams(temperature=0.8, top_k=10, seed=8)
    want_a, want_b = _mlx_lm_draws(a, range(DRAWS), row=0), _mlx_lm_draws(b, range(DRAWS), row=1)
    row_a, row_b = RowSampler(a, [5]), RowSampler(b, [6])
    got_a, got_b = [], []
    for step in range(DRAWS):
        got_a.append(row_a.sample(_logits(step, 0), mx.array([5])).item())
        got_b.append(row_b.sample(_logits(step, 1), mx.array([6])).item())
    assert (got_a, got_b) == (want_a, want_b)
    assert want_a != want_b


def test_sampling_leaves_the_global_key_alone() -> None:
    """A row's draws never advance mx.random's global state (siblings and other code keep theirs)."""
    mx.random.seed(99)
    before = mx.random.state[0].tolist()
    RowSampler(SamplingParams(temperature=1.0, seed=1), [1]).sample(_logits(0), mx.array([1])).item()
    RowSampler(SamplingParams(temperature=1.0), [1]).sample(_logits(0), mx.array([1])).item()
    assert mx.random.state[0].tolist() == before


def test_unseeded_rows_draw_independent_sequences() -> None:
    """Without a seed each row gets a fresh random key: two rows on the same logits diverge."""
    params = SamplingParams(temperature=1.5)
    a, b = RowSampler(params, [1]), RowSampler(params, [1])
    draws_a = [a.sample(_logits(s), mx.array([1])).item() for s in range(DRAWS)]
    draws_b = [b.sample(_logits(s), mx.array([1])).item() for s in range(DRAWS)]
    assert draws_a != draws_b


def _mlx_lm_processed_greedy(params: SamplingParams, prompt: list[int], inputs: list[int], row: int) -> list[int]:
    """generate_step's context (prompt[:-1] prefilled, then each step's input) through mlx-lm's processors."""
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None, repetition_penalty=params.repetition_penalty or None,
        presence_penalty=params.presence_penalty or None, frequency_penalty=params.frequency_penalty or None,
    )
    context = list(prompt[:-1])
    draws = []
    for step, token in enumerate(inputs):
        context.append(token)
        logits = _logits(step, row)
        for processor in processors:
            logits = processor(mx.array(context), logits)
        draws.append(mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1).item())
    return draws


def test_processors_read_each_rows_own_context() -> None:
    """Penalties see only the row's prompt and fed tokens, even with another row sampled in between."""
    params = SamplingParams(repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=1.0,
                            logit_bias=((4, 1.5),))
    prompts = {0: [10, 11, 12, 13], 1: [20, 21]}
    inputs = {0: [13, 30, 31, 32, 33, 34], 1: [21, 40, 41, 42, 43, 44]}
    rows = {r: RowSampler(params, prompts[r]) for r in prompts}
    got: dict[int, list[int]] = {0: [], 1: []}
    for step in range(6):
        for r, sampler in rows.items():
            got[r].append(sampler.sample(_logits(step, r), mx.array(inputs[r][step : step + 1])).item())
    for r in rows:
        assert got[r] == _mlx_lm_processed_greedy(params, prompts[r], inputs[r], r)
    # The penalties change the choice somewhere, or this test could not fail.
    plain = [mx.argmax(_logits(s, 0), axis=-1).item() for s in range(6)]
    assert got[0] != plain


def test_is_plain_greedy_only_without_temperature_or_processors() -> None:
    """Only temperature 0 without processors may take the batch's vectorized argmax."""
    assert RowSampler(SamplingParams(), [1]).is_plain_greedy
    assert not RowSampler(SamplingParams(repetition_penalty=1.1), [1]).is_plain_greedy
    assert not RowSampler(SamplingParams(logit_bias=((3, 1.0),)), [1]).is_plain_greedy
    assert not RowSampler(SamplingParams(temperature=0.5, seed=1), [1]).is_plain_greedy


def test_greedy_is_argmax_of_logprobs() -> None:
    """Temperature 0 returns mlx-lm's greedy_sampler's token."""
    sampler = RowSampler(SamplingParams(), [1])
    for step in range(5):
        logits = _logits(step)
        assert sampler.sample(logits, mx.array([1])).item() == mx.argmax(logits, axis=-1).item()
