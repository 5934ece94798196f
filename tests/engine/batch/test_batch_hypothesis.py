"""Random arrival schedules at B <= 8: every row decodes exactly its solo greedy tokens and no KV remains."""

from __future__ import annotations

from functools import cache
from typing import Any

import attrs
from hypothesis import example, given, settings, target
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.generate import generate_step
import mlx.core as mx

from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

from mlx_trio.testing import batch_reference as ref

PREFILL_STEP_SIZE = 8
PADDED_TOLERANCE = 1e-4


@cache
def _llama() -> tuple[Any, tuple[int, ...]]:
    model, tokenizer = load(str(tiny_model(LLAMA)))
    return model, tuple(tokenizer.eos_token_ids)


def _mlx_lm_tokens(model: Any, a: ref.Arrival, eos: tuple[int, ...]) -> list[int]:
    """The request alone through mlx-lm's own `generate_step` (greedy), stopped at EOS or max_tokens."""
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(a.prompt_ids), model, max_tokens=a.params.max_tokens,
                                  prefill_step_size=PREFILL_STEP_SIZE):
        tokens.append(int(token))
        if tokens[-1] in eos:
            break
    return tokens


@st.composite
def schedules(draw: st.DrawFn) -> list[ref.Arrival]:
    arrivals = []
    for i in range(draw(st.integers(1, 10))):
        length = draw(st.integers(1, 40))
        arrivals.append(ref.Arrival(
            request_id=f"r{i}",
            at_step=draw(st.integers(0, 6)),
            prompt_ids=tuple(draw(st.lists(st.integers(3, 511), min_size=length, max_size=length))),
            params=SamplingParams(max_tokens=draw(st.integers(1, 12))),
        ))
    return arrivals


# Ten rows at once: the batch fills to 8, two wait in the queue for a free row.
_FULL = [ref.Arrival(f"r{i}", i % 3, tuple((37 * i + 11 * j) % 509 + 3 for j in range(4 * i + 1)),
                     SamplingParams(max_tokens=12 - i)) for i in range(10)]


@settings(max_examples=15)
@given(arrivals=schedules())
@example(arrivals=_FULL)
def test_random_schedules_decode_solo_tokens_and_free_all_kv(arrivals: list[ref.Arrival]) -> None:
    """Tokens == mlx-lm's generate_step alone; logits == the solo run's (unpadded exact, padded within 1e-4); 0 KV bytes."""
    model, eos = _llama()
    got = ref.run_schedule(ref.ours(model, prefill_step_size=PREFILL_STEP_SIZE), arrivals, eos=eos, max_batch=8)
    want = ref.run_schedule(ref.reference(model, prefill_step_size=PREFILL_STEP_SIZE), arrivals, eos=eos,
                            max_batch=8)
    assert got.max_batch <= 8
    target(float(got.max_batch))  # steer the search towards full batches
    assert got.final_nbytes == 0
    assert got.tokens == want.tokens
    for a in arrivals:
        assert got.tokens[a.request_id] == _mlx_lm_tokens(model, a, eos)
        solo = ref.run_schedule(ref.ours(model, prefill_step_size=PREFILL_STEP_SIZE), [attrs.evolve(a, at_step=0)],
                                eos=eos)
        for key, diff in ref.logit_diffs(got, solo).items():
            assert diff <= (PADDED_TOLERANCE if want.padded[key] else 0.0), (key, diff)
