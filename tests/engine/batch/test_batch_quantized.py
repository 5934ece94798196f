"""Quantized KV (`--kv-bits`) through the batch lane == mlx-lm's serial `generate_step(kv_bits=...)`, row by row.

The oracle for a row is mlx-lm's `generate_step` with the same bits, group
size and prefill chunks, and `quantized_kv_start` = the scheme's start, or,
for a row its batch converted before the row reached the start, the row's
token count at that moment (engine/kv/kv_scheme.py states the rule).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.params import SamplingParams
from mlx_trio.testing import batch_reference
from mlx_trio.testing.batch_reference import Arrival
from mlx_trio.testing.tiny_models import TinyModelSpec, tiny_model
from tests.engine.batch.batch_driver import run_schedule

# Heads of 64 dims (mx.quantize's groups are 32, 64 or 128 wide); two query heads per KV head (GQA).
LLAMA_Q = TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1)
STEP = 7  # prefill chunk: prompts cross chunk edges and the start inside a chunk
# 4-bit groups of 32 change greedy tokens of this model against bf16 (checked below): the tests can fail.
SCHEME = KvScheme(bits=4, group_size=32, start=0)


@cache
def _llama() -> tuple[Any, tuple[int, ...]]:
    model, tokenizer = load(str(tiny_model(LLAMA_Q)))
    return model, tuple(tokenizer.eos_token_ids)


@cache
def _qwen3_next() -> Any:
    return batch_reference.tiny_qwen3_next(head_dim=32)


def _serial(model: Any, prompt: tuple[int, ...], max_tokens: int, eos: tuple[int, ...], scheme: KvScheme | None,
            start: int | None = None) -> list[int]:
    """mlx-lm alone (greedy), with `scheme`'s format from `start` (default: the scheme's), stopped at EOS."""
    quant = {} if scheme is None else {"kv_bits": scheme.bits, "kv_group_size": scheme.group_size,
                                       "quantized_kv_start": scheme.start if start is None else start}
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=make_prompt_cache(model),
                                  prefill_step_size=STEP, **quant):
        tokens.append(int(token))
        if tokens[-1] in eos:
            break
    return tokens


def _prompt(i: int, n: int, vocab: int = 509) -> tuple[int, ...]:
    return tuple((37 * i + 11 * j) % (vocab - 3) + 3 for j in range(n))


def _check_rows(model: Any, eos: tuple[int, ...], arrivals: list[Arrival], scheme: KvScheme) -> dict[str, int]:
    """Every row's tokens == its serial oracle; returns where each row's batch converted it."""
    converted: dict[str, int] = {}
    got = run_schedule(model, arrivals, eos=eos, prefill_step_size=STEP, kv_scheme=scheme, converted_at=converted)
    for a in arrivals:
        start = min(scheme.start, converted.get(a.request_id, scheme.start))
        assert got[a.request_id].tokens == _serial(model, a.prompt_ids, a.params.max_tokens, eos, scheme, start), \
            (a.request_id, start)
    return converted


def test_the_scheme_changes_tokens() -> None:
    """Against bf16, so that equality with the quantized oracle below means something."""
    model, eos = _llama()
    prompt = _prompt(1, 37)
    assert _serial(model, prompt, 24, eos, SCHEME) != _serial(model, prompt, 24, eos, None)


@pytest.mark.parametrize("scheme", [KvScheme(bits=4, group_size=32, start=s) for s in (0, 6, 20, 36, 37, 45, 5000)]
                         + [KvScheme(bits=8, group_size=64, start=10)])
def test_b1_is_generate_step_with_the_same_scheme(scheme: KvScheme) -> None:
    """A lone row (start before, inside and after the prompt, and during decode) == generate_step's tokens."""
    model, eos = _llama()
    prompt = _prompt(1, 37)
    got = run_schedule(model, [Arrival("a", 0, prompt, SamplingParams(max_tokens=24))], eos=eos,
                       prefill_step_size=STEP, kv_scheme=scheme)["a"].tokens
    assert got == _serial(model, prompt, 24, eos, scheme)
    assert len(got) >= 8


@pytest.mark.parametrize("start", [0, 12])
def test_hybrid_b1_keeps_recurrent_state_and_matches_generate_step(start: int) -> None:
    """qwen3-next: its full-attention layers quantize, its recurrent ArraysCache layers stay as they are."""
    model = _qwen3_next()
    scheme = KvScheme(bits=4, group_size=32, start=start)
    prompt = _prompt(2, 30, vocab=256)
    got = run_schedule(model, [Arrival("a", 0, prompt, SamplingParams(max_tokens=16))], eos=(),
                       prefill_step_size=STEP, kv_scheme=scheme)["a"].tokens
    assert got == _serial(model, prompt, 16, (), scheme)


def test_unpadded_rows_in_a_quantized_batch_are_exact() -> None:
    """Rows of one length arriving together never pad: each == its serial run, the batch quantized from the start."""
    model, eos = _llama()
    arrivals = [Arrival(f"r{i}", 0, _prompt(i, 21), SamplingParams(max_tokens=14)) for i in range(4)]
    converted = _check_rows(model, eos, arrivals, SCHEME)
    assert set(converted) == {a.request_id for a in arrivals}


def test_rows_joining_and_leaving_across_the_start() -> None:
    """bf16 rows, one crossing the start inside the batch (all convert), later joiners below the start converted
    at join, leavers, a lone survivor extracted back to a serial QuantizedKVCache: each row == its oracle."""
    model, eos = _llama()
    scheme = KvScheme(bits=4, group_size=32, start=30)
    arrivals = [
        Arrival("long", 0, _prompt(0, 25), SamplingParams(max_tokens=20)),  # crosses 30 at its 5th step
        Arrival("short", 1, _prompt(1, 9), SamplingParams(max_tokens=6)),  # converted early, leaves
        Arrival("late", 8, _prompt(2, 12), SamplingParams(max_tokens=18)),  # joins a quantized batch in bf16
        Arrival("past", 9, _prompt(3, 33), SamplingParams(max_tokens=8)),  # quantized by its own prefill
    ]
    converted = _check_rows(model, eos, arrivals, scheme)
    assert converted["long"] == 30 and converted["short"] < 30 and converted["late"] == 12
    assert converted["past"] >= 30


@settings(max_examples=4)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=6),
       st.sampled_from([0, 10, 30]))
@example([(0, 30, 12), (2, 5, 10), (3, 40, 4), (6, 1, 8)], 30)
def test_random_join_leave_schedules_keep_each_row_on_its_oracle(rows: list[tuple[int, int, int]], start: int) -> None:
    """Random arrivals of quantized and not-yet-quantized rows: every row's tokens == its serial oracle."""
    model, eos = _llama()
    arrivals = [Arrival(f"r{i}", at, _prompt(i, n), SamplingParams(max_tokens=m)) for i, (at, n, m) in enumerate(rows)]
    _check_rows(model, eos, arrivals, KvScheme(bits=4, group_size=32, start=start))


def test_prefill_converts_at_the_first_chunk_reaching_the_start() -> None:
    """mlx-lm's rule: after the chunk whose end reaches the start, not before (so start=0 converts after chunk 1)."""
    from mlx_trio.engine.batch.solo_row import SoloRow

    model, _ = _llama()
    row = SoloRow(model, "a", _prompt(0, 20), SamplingParams(), prefill_step_size=STEP,
                  kv_scheme=KvScheme(bits=8, group_size=64, start=10))
    row.prefill_chunk()
    assert type(row.caches[0]) is KVCache  # 7 tokens
    row.prefill_chunk()
    assert type(row.caches[0]) is QuantizedKVCache  # 14 >= 10
    row.close()


@pytest.mark.parametrize("case", ["seeded_top_p", "seeded_penalties", "greedy_bias_penalty"])
def test_b1_sampling_options_compose_with_quantized_kv(case: str) -> None:
    """Seeds, top-p, penalties, logit bias at B=1 == generate_step(kv_bits=...) with mlx-lm's own sampler."""
    from tests.engine.batch.test_batch_b1 import CASES, _mlx_lm_sampling

    model, eos = _llama()
    prompt = _prompt(1, 37)
    params = SamplingParams(max_tokens=20, **CASES[case])
    if params.seed is not None:
        mx.random.seed(params.seed)
    want = [int(t) for t, _ in generate_step(
        mx.array(prompt), model, max_tokens=20, prompt_cache=make_prompt_cache(model), prefill_step_size=STEP,
        kv_bits=SCHEME.bits, kv_group_size=SCHEME.group_size, quantized_kv_start=SCHEME.start,
        **_mlx_lm_sampling(params))]
    got = run_schedule(model, [Arrival("a", 0, prompt, params)], eos=(), prefill_step_size=STEP,
                       kv_scheme=SCHEME)["a"].tokens
    assert got == want


def test_grammar_logprobs_and_seeds_in_a_quantized_batch_equal_their_solo_runs() -> None:
    """A JSON-constrained row, a seeded row with logprobs and a penalised row share quantized steps:
    each == its run alone (tokens and logprobs), and the batch reports its quantized bytes."""
    import json

    from mlx_trio.engine.sampling.grammar import build_grammar_tokenizer
    from mlx_trio.params import Constraint

    model, _ = _llama()
    tokenizer = load(str(tiny_model(LLAMA_Q)))[1]
    grammar = build_grammar_tokenizer(tokenizer, tokenizer.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    arrivals = [
        Arrival("json", 0, _prompt(0, 9), SamplingParams(max_tokens=40, constraint=Constraint("json_schema",
                                                                                             json.dumps(schema)))),
        Arrival("seeded", 1, _prompt(1, 15), SamplingParams(max_tokens=16, temperature=0.8, seed=5, logprobs=True,
                                                             top_logprobs=2)),
        Arrival("penalised", 3, _prompt(2, 6), SamplingParams(max_tokens=12, repetition_penalty=1.3)),
    ]
    eos = tuple(tokenizer.eos_token_ids)
    together = run_schedule(model, arrivals, eos=eos, grammar_tokenizer=grammar, prefill_step_size=STEP,
                            kv_scheme=SCHEME)
    for a in arrivals:
        alone = run_schedule(model, [Arrival(a.request_id, 0, a.prompt_ids, a.params)], eos=eos,
                             grammar_tokenizer=grammar, prefill_step_size=STEP, kv_scheme=SCHEME)[a.request_id]
        assert together[a.request_id].tokens == alone.tokens, a.request_id
        assert together[a.request_id].logprobs == alone.logprobs, a.request_id
    assert json.loads(tokenizer.decode(together["json"].tokens[:-1]))["a"] in range(10)


def test_the_batch_reports_its_quantized_bytes() -> None:
    """DecodeBatch.nbytes (what /stats.batch.kv_bytes shows) is the packed values, scales and biases held."""
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow

    model, _ = _llama()
    sizes = {}
    for scheme in (KvScheme(), SCHEME):
        batch = DecodeBatch(model, scheme)
        rows = []
        for i in range(2):
            row = SoloRow(model, f"r{i}", _prompt(i, 300), SamplingParams(), prefill_step_size=512, kv_scheme=scheme)
            row.prefill_chunk()
            rows.append((row, row.first_token()))
        batch.join_many(rows)
        assert batch.is_quantized == scheme.quantized
        layers = batch._caches
        sizes[scheme.bits] = batch.nbytes
        parts = [p for c in layers for p in ((*c.keys, *c.values) if scheme.quantized else (c.keys, c.values))]
        assert batch.nbytes == sum(p.nbytes for p in parts)
        batch.close()
    assert sizes[4] * 4 < sizes[None]  # float32 values: 4 bits + a scale and bias per 32
