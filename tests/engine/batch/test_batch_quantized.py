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


def test_the_quantized_warm_up_frees_its_arrays() -> None:
    """warm_up with a quantized scheme takes quantized rows through the lane's operations and leaves nothing."""
    import gc

    from mlx_trio.engine.batch.warmup import warm_up

    model, _ = _llama()
    mx.clear_cache()
    before = mx.get_active_memory()
    warm_up(model, 509, KvScheme(bits=8, group_size=64, start=0))
    gc.collect()
    assert mx.get_active_memory() - before < 1024


LLAMA_Q_SWA = TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1, sliding_window=16)


def _serial_full_layers_only(model: Any, prompt: tuple[int, ...], max_tokens: int, scheme: KvScheme,
                             start: int) -> list[int]:
    """generate_step's loop (greedy), converting only full-attention layers: mlx-lm's own raises on its
    rotating ones (`RotatingKVCache.to_quantized`), so this is the serial oracle for a sliding-window model."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import RotatingKVCache

    caches = make_prompt_cache(model)
    full = [i for i, c in enumerate(caches) if not isinstance(c, RotatingKVCache)]

    def forward(tokens: mx.array) -> mx.array:
        logits = model(tokens[None], cache=caches)
        layers = [caches[i] for i in full]
        maybe_quantize_kv_cache(layers, start, scheme.group_size, scheme.bits)
        for i, layer in zip(full, layers, strict=True):
            caches[i] = layer
        return logits[:, -1, :]

    rest = list(prompt)
    while len(rest) > 1:
        n = min(STEP, len(rest) - 1)
        forward(mx.array(rest[:n]))
        mx.eval([c.state for c in caches])
        rest = rest[n:]
    tokens = [int(mx.argmax(forward(mx.array(rest)), axis=-1).item())]
    while len(tokens) < max_tokens:
        tokens.append(int(mx.argmax(forward(mx.array(tokens[-1:])), axis=-1).item()))
    return tokens


def test_sliding_window_layers_stay_bf16_and_rows_match_the_serial_loop() -> None:
    """Full-attention layers quantize, rotating ones keep their window in bf16; alone and joining/leaving,
    each row == the serial loop with its conversion point."""
    from mlx_lm.models.cache import BatchRotatingKVCache

    model = load(str(tiny_model(LLAMA_Q_SWA)))[0]
    scheme = KvScheme(bits=4, group_size=32, start=20)
    arrivals = [Arrival("a", 0, _prompt(0, 30), SamplingParams(max_tokens=20)),
                Arrival("b", 2, _prompt(1, 9), SamplingParams(max_tokens=14)),
                Arrival("c", 6, _prompt(2, 18), SamplingParams(max_tokens=10))]
    converted: dict[str, int] = {}
    got = run_schedule(model, arrivals, eos=(), prefill_step_size=STEP, kv_scheme=scheme, converted_at=converted)
    for a in arrivals:
        start = min(scheme.start, converted.get(a.request_id, scheme.start))
        assert got[a.request_id].tokens == _serial_full_layers_only(model, a.prompt_ids, a.params.max_tokens,
                                                                    scheme, start), a.request_id
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow

    batch = DecodeBatch(model, scheme)
    for a in arrivals[:2]:
        row = SoloRow(model, a.request_id, a.prompt_ids, a.params, prefill_step_size=STEP, kv_scheme=scheme)
        while row.prefill_chunk():
            pass
        batch.join_many([(row, row.first_token())])
    kinds = {type(c).__name__ for c in batch._caches}
    assert kinds == {"BatchQuantizedKVCache", BatchRotatingKVCache.__name__}
    batch.close()


def _decode_alone(model: Any, row: Any, steps: int) -> list[int]:
    from mlx_trio.engine.batch.decode_batch import DecodeBatch

    while row.prefill_chunk():
        pass
    tokens = [row.first_token()]
    batch = DecodeBatch(model, row.kv_scheme)
    batch.join_many([(row, tokens[0])])
    while len(tokens) < steps:
        decoded = batch.step_decoded()
        if decoded is not None:
            tokens.append(decoded.token_ids[0])
    batch.close()
    return tokens


@pytest.mark.parametrize("at", [10, 25], ids=["bf16_entry", "quantized_entry"])
def test_a_hit_restored_before_or_after_the_start_equals_the_run_that_stored_it(at: int) -> None:
    """A snapshot at `at` (start 18: below it the entry is bf16 and the hit crosses the start in its own
    prefill; above it the entry is quantized): the hit's tokens == the uncached run that took the snapshot."""
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.engine.prompt_cache.ram_tier import CacheHit

    model, _ = _llama()
    scheme = KvScheme(bits=4, group_size=32, start=18)
    prompt, params = _prompt(3, 37), SamplingParams(max_tokens=16)
    first = SoloRow(model, "a", prompt, params, prefill_step_size=STEP, snapshot_at=at, kv_scheme=scheme)
    while first.fed < at:
        first.prefill_chunk()
    entry = first.snapshot()
    assert (type(entry.caches[0]) is QuantizedKVCache) == (at >= scheme.start)
    cold = _decode_alone(model, first, 16)
    warm = _decode_alone(model, SoloRow(model, "b", prompt, params, prefill_step_size=STEP, kv_scheme=scheme,
                                        hit=CacheHit(entry, at)), 16)
    assert warm == cold


def test_a_row_extracted_from_a_quantized_batch_restores_to_its_own_continuation() -> None:
    """cache_entry of a batched row after its batch converted: a serial QuantizedKVCache entry of the tokens the row
    held when it converted (`KvScheme.entry_cut`), whose hit continues exactly as the row did from there."""
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.engine.prompt_cache.ram_tier import CacheHit

    model, _ = _llama()
    scheme = KvScheme(bits=4, group_size=32, start=20)
    batch = DecodeBatch(model, scheme)
    rows = []
    for i, n in enumerate((16, 11)):  # neither past the start at join: the batch converts mid-decode
        row = SoloRow(model, f"r{i}", _prompt(i, n), SamplingParams(), prefill_step_size=STEP, kv_scheme=scheme)
        while row.prefill_chunk():
            pass
        rows.append((row, row.first_token()))
    batch.join_many(rows)
    tokens = {"r0": [rows[0][1]], "r1": [rows[1][1]]}
    for _ in range(8):
        decoded = batch.step_decoded()
        if decoded is not None:
            for rid, t in zip(batch.request_ids, decoded.token_ids, strict=True):
                tokens[rid].append(t)
    for rid, t in zip(batch.request_ids, batch.flush_decoded().token_ids, strict=True):
        tokens[rid].append(t)
    assert batch.is_quantized
    held = _prompt(1, 11) + tuple(tokens["r1"][:-1])  # the last token read is not fed yet
    entry = batch.cache_entry("r1", held)
    # r0 reached 20 after 4 steps, when r1 held 11 + 4 tokens: r1's oracle converts at 15, and its entry keeps those.
    assert entry is not None and type(entry.caches[0]) is QuantizedKVCache and entry.tokens == held[:15]
    batch.close()
    resumed = SoloRow(model, "again", held[:15] + (tokens["r1"][4],), SamplingParams(), kv_scheme=scheme,
                      hit=CacheHit(entry, 15))
    following = resumed.first_token()
    resumed.close()
    n = len(tokens["r1"])
    oracle = _serial(model, _prompt(1, 11), n, (), scheme, start=15)
    assert tokens["r1"] == oracle and following == oracle[5]


def test_hybrid_rows_join_and_leave_across_the_start() -> None:
    """qwen3-next in a batch: attention layers convert with the batch, recurrent state batches unquantized."""
    model = _qwen3_next()
    arrivals = [Arrival("a", 0, _prompt(0, 14, vocab=256), SamplingParams(max_tokens=14)),
                Arrival("b", 2, _prompt(1, 6, vocab=256), SamplingParams(max_tokens=6)),
                Arrival("c", 5, _prompt(2, 25, vocab=256), SamplingParams(max_tokens=8))]
    converted = _check_rows(model, (), arrivals, KvScheme(bits=4, group_size=32, start=18))
    assert converted["a"] == 18 and converted["b"] < 18 and converted["c"] >= 18
