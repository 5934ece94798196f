"""Logprobs are mlx-lm's: `generate_step`'s processed log-softmax, on both lanes and at B=4."""

from __future__ import annotations

import json
import math
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from tests.engine.batch.batch_driver import Arrival, Outcome, run_schedule
from mlx_trio.engine.sampling.grammar import build_grammar_tokenizer
from mlx_trio.params import Constraint, SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

TOP = 5
MAX_TOKENS = 12
# Padded rows of a B=4 batch reorder float32 sums; every logprob stays this close.
BATCH_TOLERANCE = 1e-4

PARAMS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=TOP),
    "processors": SamplingParams(max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=TOP, repetition_penalty=1.3,
                                 logit_bias=((100, 2.5), (7, -3.0))),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=TOP, temperature=0.9, top_p=0.9,
                             seed=42),
    "sampled-token-only": SamplingParams(max_tokens=MAX_TOKENS, logprobs=True, temperature=1.2, top_k=20, seed=7),
}
PROMPTS = {name: tuple((31 * i + 17 * j) % 500 + 3 for j in range(6 + 3 * i)) for i, name in enumerate(PARAMS)}


@cache
def _model() -> tuple[Any, Any]:
    model, tokenizer = load(str(tiny_model(LLAMA)))
    return model, tokenizer


@cache
def mlx_lm_reference(name: str) -> tuple[list[int], list[np.ndarray]]:
    """mlx-lm's tokens and full logprob vectors for one request, seeded as mlx_lm.server seeds it."""
    model, tokenizer = _model()
    params = PARAMS[name]
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    processors = make_logits_processors(logit_bias=dict(params.logit_bias) or None,
                                        repetition_penalty=params.repetition_penalty or None)
    if params.seed is not None:
        mx.random.seed(params.seed)
    tokens, vectors = [], []
    for token, logprobs in generate_step(mx.array(PROMPTS[name]), model, max_tokens=params.max_tokens,
                                         sampler=sampler, logits_processors=processors):
        tokens.append(int(token))
        vectors.append(np.array(logprobs))
        if token in tokenizer.eos_token_ids:
            break
    return tokens, vectors


def assert_matches_reference(name: str, got: Outcome, *, tolerance: float) -> None:
    tokens, vectors = mlx_lm_reference(name)
    assert got.tokens == tokens
    k = PARAMS[name].top_logprobs
    for token, record, vector in zip(tokens, got.logprobs, vectors, strict=True):
        assert record is not None
        assert abs(record.logprob - float(vector[token])) <= tolerance
        assert len(record.top) == k
        want = np.sort(vector)[::-1][:k]
        assert np.allclose([lp for _, lp in record.top], want, rtol=0, atol=tolerance)
        assert all(abs(lp - float(vector[tid])) <= tolerance for tid, lp in record.top)
        assert [lp for _, lp in record.top] == sorted((lp for _, lp in record.top), reverse=True)
        if tolerance == 0.0:
            assert record.logprob == float(vector[token])  # the very same float32, widened


@pytest.mark.parametrize("name", list(PARAMS))
def test_a_lone_batch_row_has_mlx_lm_logprobs(name: str) -> None:
    """B=1 (`--batch 1`; token 0 from the solo row, then the adopted serial graph): each token's logprob
    and top-5 are bit-identical to generate_step's logprob vector."""
    model, tokenizer = _model()
    out = run_schedule(model, [Arrival(name, 0, PROMPTS[name], PARAMS[name])], eos=tokenizer.eos_token_ids,
                       prefill_step_size=2048)
    assert_matches_reference(name, out[name], tolerance=0.0)


def test_four_batched_rows_keep_their_logprobs() -> None:
    """B=4 (different prompt lengths, so padded rows; one joins late): within float32 tolerance of mlx-lm."""
    model, tokenizer = _model()
    arrivals = [Arrival(name, 2 * i, PROMPTS[name], PARAMS[name]) for i, name in enumerate(PARAMS)]
    out = run_schedule(model, arrivals, eos=tokenizer.eos_token_ids, prefill_step_size=2048)
    for name in PARAMS:
        assert_matches_reference(name, out[name], tolerance=BATCH_TOLERANCE)


def test_plain_rows_beside_logprob_rows_report_none() -> None:
    """A row that does not ask gets no record (and keeps the batched argmax); one that asks gets all of them."""
    model, tokenizer = _model()
    arrivals = [Arrival("plain", 0, PROMPTS["greedy"], SamplingParams(max_tokens=MAX_TOKENS)),
                Arrival("greedy", 0, PROMPTS["greedy"], PARAMS["greedy"])]
    out = run_schedule(model, arrivals, eos=tokenizer.eos_token_ids)
    assert out["plain"].logprobs == [None] * len(out["plain"].tokens)
    assert out["plain"].tokens == out["greedy"].tokens
    assert all(record is not None for record in out["greedy"].logprobs)


def test_constrained_logprobs_come_from_the_masked_distribution() -> None:
    """With a grammar, top logprobs list only allowed tokens, all finite, and they sum to at most 1."""
    model, tokenizer = _model()
    grammar_tokenizer = build_grammar_tokenizer(tokenizer, tokenizer.eos_token_ids)
    params = SamplingParams(max_tokens=20, logprobs=True, top_logprobs=20,
                            constraint=Constraint("json_schema", json.dumps({"enum": ["red", "green"]})))
    out = run_schedule(model, [Arrival("c", 0, PROMPTS["greedy"], params)], eos=tokenizer.eos_token_ids,
                       grammar_tokenizer=grammar_tokenizer)["c"]
    assert json.loads(tokenizer.decode(out.tokens[:-1])) in ("red", "green")
    first = out.logprobs[0]
    assert first is not None and 1 <= len(first.top) < 20  # only a few tokens can start `"red"`/`"green"`
    assert all(tokenizer.decode([tid]).startswith('"') for tid, _ in first.top)
    assert sum(math.exp(lp) for _, lp in first.top) == pytest.approx(1.0, abs=1e-5)
    assert out.logprobs[-1] is not None and out.logprobs[-1].logprob == pytest.approx(0.0, abs=1e-6)  # EOS forced


def test_batch_records_are_each_rows_own_record() -> None:
    """`BatchLogprobs.records` (one `tolist()` per group) is `to_record` of each row, -inf entries left out."""
    from mlx_trio.engine.sampling.token_logprobs import BatchLogprobs, to_record

    top_ids = mx.array([[4, 9, 1], [3, 0, 2]], dtype=mx.int32)
    top_values = mx.array([[-0.25, -1.5, -math.inf], [-0.5, -0.75, -2.0]], dtype=mx.bfloat16)
    chosen = mx.array([-0.25, -0.75], dtype=mx.bfloat16)
    # Row 1 of the batch asks k=3 (group row 0), row 0 too (group row 1); row 2 did not ask; -1 left the batch.
    batch = BatchLogprobs(3, (((1, 0), chosen, top_ids, top_values),))
    records = batch.records()
    assert records[2] is None
    for group_row, batch_row in ((0, 1), (1, 0)):
        want = to_record((chosen[group_row], top_ids[group_row], top_values[group_row]))
        assert records[batch_row] == want
        assert all(type(i) is int and type(v) is float for i, v in records[batch_row].top)
    assert records[1].top == ((4, -0.25), (9, -1.5))
