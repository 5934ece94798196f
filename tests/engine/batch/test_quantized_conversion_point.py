"""A quantized solo row's KV == mlx-lm's serial `generate_step(kv_bits=...)` KV, bit for bit, however its prefill
is split (issue #44 point 2): snapshot boundaries, chunk-size limits, prompt-cache hits on bf16 or quantized entries.

The row must convert exactly where generate_step's own chunks convert (`KvScheme.conversion_point`): the tokens
before that point attend bf16 KV, those after it quantized KV, in both runs.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.prompt_cache.ram_tier import CacheHit
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import TinyModelSpec, tiny_model

LLAMA_Q = TinyModelSpec("llama", hidden_size=128, heads=2, kv_heads=1)  # 64-dim heads
SCHEMES = [KvScheme(bits=8, group_size=64, start=0), KvScheme(bits=4, group_size=32, start=0),
           KvScheme(bits=8, group_size=64, start=9)]


@cache
def _model() -> Any:
    return load(str(tiny_model(LLAMA_Q)))[0]


def _prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple((31 * j + 7 + salt * (j >= 12)) % 500 + 3 for j in range(n))


def _serial(prompt: tuple[int, ...], step: int, scheme: KvScheme) -> tuple[int, list[Any]]:
    """generate_step's token 0 and its caches (they then also hold token 0's KV: the next step runs ahead).

    When mlx-lm converts only after that next step, its bf16 run stands in: the same KV up to there.
    """
    caches = make_prompt_cache(_model())
    bits = scheme.bits if scheme.conversion_point(len(prompt), step) <= len(prompt) else None
    token, _ = next(generate_step(mx.array(prompt), _model(), prompt_cache=caches, prefill_step_size=step,
                                  kv_bits=bits, kv_group_size=scheme.group_size,
                                  quantized_kv_start=scheme.start))
    return int(token), caches


def _kv(caches: list[Any], n: int) -> list[mx.array]:
    """Every layer's stored key/value arrays (quantized parts too), cut to the first `n` positions."""
    return [x[..., :n, :] for c in caches for _, x in tree_flatten((c.keys, c.values))]


def _row(prompt: tuple[int, ...], step: int, scheme: KvScheme, limits: list[int], *, snapshot_at: int | None = None,
         hit: CacheHit | None = None) -> SoloRow:
    row = SoloRow(_model(), "r", prompt, SamplingParams(), prefill_step_size=step, kv_scheme=scheme,
                  snapshot_at=snapshot_at, hit=hit)
    i = 0
    while row.prefill_remaining:
        row.prefill_chunk(limits[i % len(limits)] if limits else None)
        i += 1
    return row


def _assert_serial(row: SoloRow, prompt: tuple[int, ...], step: int, scheme: KvScheme) -> None:
    token, caches = _serial(prompt, step, scheme)
    assert row.first_token() == token
    assert [type(c) for c in row.caches] == [type(c) for c in caches]
    assert all(mx.array_equal(a, b).item() for a, b in zip(_kv(row.caches, len(prompt)), _kv(caches, len(prompt)),
                                                            strict=True))
    row.close()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), step=st.integers(1, 48), scheme=st.sampled_from(SCHEMES),
       limits=st.lists(st.integers(1, 12), max_size=3), split=st.integers(1, 39))
@example(n=30, step=2048, scheme=SCHEMES[0], limits=[], split=12)  # the issue: a snapshot in mlx-lm's one chunk
@example(n=30, step=2048, scheme=SCHEMES[0], limits=[5], split=12)  # a busy prefill's smaller chunks
def test_a_split_prefill_converts_where_generate_step_does(n: int, step: int, scheme: KvScheme, limits: list[int],
                                                           split: int) -> None:
    prompt = _prompt(n)
    _assert_serial(_row(prompt, step, scheme, limits, snapshot_at=split if split < n else None), prompt, step, scheme)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(14, 40), stored=st.integers(13, 45), step=st.integers(1, 48), scheme=st.sampled_from(SCHEMES),
       split=st.integers(1, 44))
@example(n=30, stored=40, step=2048, scheme=SCHEMES[0], split=12)  # a bf16 snapshot hit
@example(n=30, stored=28, step=2048, scheme=SCHEMES[0], split=27)  # a quantized entry below the point: declined
def test_a_row_from_a_prompt_cache_hit_equals_generate_step(n: int, stored: int, step: int, scheme: KvScheme,
                                                            split: int) -> None:
    """Another prompt (sharing the first 12 tokens, or more when it is the same) stores a snapshot; this row starts
    from what of it `usable_hit` allows and still has mlx-lm's KV."""
    other = _prompt(stored, salt=1)
    prompt = _prompt(n)
    first = _row(other, step, scheme, [], snapshot_at=split if split < stored else None)
    entry = first.snapshot()
    first.close()
    shared = next((i for i, (a, b) in enumerate(zip(entry.tokens, prompt)) if a != b), min(len(entry.tokens), n))
    usable = min(shared, n - 1)
    limit = scheme.hit_limit(n, step)
    usable = limit(entry.quantized, len(entry.tokens), usable) if usable else 0
    hit = CacheHit(entry, usable) if usable else None
    row = _row(prompt, step, scheme, [], hit=hit)
    _assert_serial(row, prompt, step, scheme)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 30), steps=st.integers(1, 8), extra=st.integers(1, 8), step=st.sampled_from([5, 16, 2048]),
       scheme=st.sampled_from(SCHEMES))
@example(n=12, steps=8, extra=3, step=16, scheme=SCHEMES[0])  # the turn that crosses mlx-lm's first full chunk
def test_a_follow_up_turn_from_a_finished_rows_entry_equals_generate_step(n: int, steps: int, extra: int, step: int,
                                                                         scheme: KvScheme) -> None:
    """A row decodes, leaves, and its entry (cut by `entry_cut`) serves the next turn, its prompt + answer + more,
    through the lookup's `hit_limit`: that turn's KV is still generate_step's."""
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.prompt_cache.ram_tier import PromptCache

    prompt = _prompt(n)
    row = _row(prompt, step, scheme, [])
    batch = DecodeBatch(_model(), scheme)
    batch.join_many([(row, row.first_token())])
    answer = [row.token0]
    for _ in range(steps):
        decoded = batch.step_decoded()
        if decoded is not None:
            answer += decoded.token_ids
    answer += batch.flush_decoded().token_ids
    held = prompt + tuple(answer[:-1])
    entry = batch.cache_entry("r", held)
    batch.close()
    cut = scheme.entry_cut(n, step)
    assert entry is not None and entry.quantized == (scheme.conversion_point(n, step) <= len(held))
    assert len(entry.tokens) == (len(held) if cut is None or not entry.quantized else cut)
    cache = PromptCache(max_bytes=2**40, max_entries=4)
    cache.put(entry)
    follow_up = held + (answer[-1],) + _prompt(extra, salt=5)[:extra]
    hit = cache.lookup(follow_up, limit=scheme.hit_limit(len(follow_up), step))
    _assert_serial(_row(follow_up, step, scheme, [], hit=hit), follow_up, step, scheme)
