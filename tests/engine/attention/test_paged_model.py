"""mlx-lm's model forward on paged KV: exact greedy tokens against mlx-lm, alone, batched, and over shared prefixes.

The model is mlx-lm's, wrapped by the routed attention (no patching); its cache list is `PagedLayerCache`s
(engine/kv/blocks/paged_kv.py). Lone rows must equal mlx-lm's `generate_step`; rows batched with per-row
lengths, joins and leaves must equal the same rows run alone; rows that reference another row's cached
prefix blocks must equal the same rows prefilled alone. After every scenario the pool is idle again.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_trio.engine.attention import paged_layout, routed_attention
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.blocks.row import PagedRow
from mlx_trio.engine.kv.blocks.pool import PoolExhausted
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, tiny_model

SPECS = {"llama": LLAMA, "qwen3": QWEN3}


@cache
def _model(name: str) -> nn.Module:
    model = load(str(tiny_model(SPECS[name])))[0]
    routed_attention.install(model)
    return model


@cache
def _golden(name: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """mlx-lm's own greedy tokens (plain model, plain KVCache)."""
    plain = _plain(name)
    return tuple(int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(prompt), plain, max_tokens=n)),
                                        range(n)))


@cache
def _plain(name: str) -> nn.Module:
    return load(str(tiny_model(SPECS[name])))[0]


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple((13 * seed + 7 * j + j * j) % 500 + 3 for j in range(n))


def _kv(name: str, block_size: int, num_blocks: int = 512) -> PagedKV:
    model = _model(name)
    shapes = paged_layout.layer_shapes(model)
    budget = num_blocks * paged_layout.BlockStorage.block_bytes(shapes, block_size, mx.float32)
    return paged_layout.paged_kv_for(model, budget, f"tiny-{name}", block_size=block_size)


def _prefill(kv: PagedKV, model: nn.Module, row: PagedRow, prompt: tuple[int, ...], chunk: int) -> int:
    """Feed the prompt past what the row holds in chunks; the first generated token."""
    rest = prompt[row.length :]
    for start in range(0, len(rest), chunk):
        logits = kv.forward(model, [row], [rest[start : start + chunk]])
    return int(mx.argmax(logits[0, -1]))


def _alone(kv: PagedKV, name: str, prompt: tuple[int, ...], n: int, chunk: int) -> tuple[int, ...]:
    model = _model(name)
    row = kv.join(prompt)
    out = [_prefill(kv, model, row, prompt, chunk)]
    while len(out) < n:
        out.append(int(mx.argmax(kv.forward(model, [row], [[out[-1]]])[0, -1])))
    kv.leave(row)
    return tuple(out)


def _assert_idle(kv: PagedKV) -> None:
    kv.pool.check()
    assert kv.pool.idle, kv.stats()


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(("block_size", "chunk"), [(1, 64), (3, 5), (16, 7), (32, 128)])
def test_lone_rows_equal_mlx_lm_generate_step(name: str, block_size: int, chunk: int) -> None:
    kv = _kv(name, block_size)
    for seed, n in ((0, 1), (1, 17), (2, 45)):
        prompt = _prompt(seed, n)
        assert _alone(kv, name, prompt, 12, chunk) == _golden(name, prompt, 12), (seed, n)
    _assert_idle(kv)


# (arrival step, prompt length, tokens to generate) per row
ROWS = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 8)), min_size=1, max_size=5)


@settings(max_examples=12)
@given(name=st.sampled_from(list(SPECS)), rows=ROWS, block_size=st.sampled_from([1, 4, 8, 16]),
       chunk=st.sampled_from([4, 64]))
def test_batched_rows_with_joins_and_leaves_equal_each_row_alone(name, rows, block_size, chunk) -> None:
    model = _model(name)
    kv = _kv(name, block_size)
    prompts = [_prompt(i + 20, n) for i, (_, n, _) in enumerate(rows)]
    got: dict[int, list[int]] = {}
    live: list[int] = []
    handles: dict[int, PagedRow] = {}
    for t in range(max(at for at, _, _ in rows) + 10):
        for i, (at, _, _) in enumerate(rows):
            if at == t:  # a join: prefilled alone, then decodes with the batch
                handles[i] = kv.join(prompts[i])
                got[i] = [_prefill(kv, model, handles[i], prompts[i], chunk)]
                live.append(i)
        leaving = [i for i in live if len(got[i]) >= rows[i][2]]
        for i in leaving:
            survivors = {j: (list(handles[j].blocks), _blocks_of(kv, handles[j])) for j in live if j != i}
            kv.leave(handles[i])
            live.remove(i)
            for j, (blocks, content) in survivors.items():  # a leave moved no other row's KV
                assert handles[j].blocks == blocks and mx.array_equal(_blocks_of(kv, handles[j]), content).item()
        if live:
            logits = kv.forward(model, [handles[i] for i in live], [[got[i][-1]] for i in live])
            for b, i in enumerate(live):
                got[i].append(int(mx.argmax(logits[b, -1])))
    for i, (_, _, n) in enumerate(rows):
        assert tuple(got[i][:n]) == _golden(name, prompts[i], n), i
    for i in live:
        kv.leave(handles[i])
    _assert_idle(kv)


def _blocks_of(kv: PagedKV, row: PagedRow) -> mx.array:
    return mx.stack([kv.storage.keys[0][mx.array(row.blocks)], kv.storage.values[-1][mx.array(row.blocks)]])


def test_exhaustion_allocates_nothing_and_leaves_the_rows_as_they_were() -> None:
    kv = _kv("llama", 4, num_blocks=3)
    row = kv.join(_prompt(0, 10))
    kv.forward(_model("llama"), [row], [_prompt(0, 10)])  # 3 blocks: the pool is full
    other = kv.join(_prompt(1, 5))
    with pytest.raises(PoolExhausted):
        kv.step([row, other], 1)
    assert len(row.blocks) == 3 and other.blocks == [] and kv.stats().used == 3
    kv.leave(row)
    kv.leave(other)
    _assert_idle(kv)


def test_sliding_window_models_keep_their_own_layout() -> None:
    model = load(str(tiny_model(LLAMA_SWA)))[0]
    routed_attention.install(model)
    assert "sliding-window" in (paged_layout.refusal(model) or "")
    with pytest.raises(ValueError, match="paged KV refused"):
        paged_layout.paged_kv_for(model, 1 << 20, "swa")


@settings(max_examples=15)
@given(name=st.sampled_from(list(SPECS)), prefix=st.integers(0, 40), tails=st.lists(st.integers(0, 12), min_size=2,
       max_size=4), block_size=st.sampled_from([1, 4, 8, 16]), first_leaves=st.booleans(),
       num_blocks=st.sampled_from([12, 512]))
def test_rows_reading_shared_prefix_blocks_equal_the_rows_prefilled_alone(name, prefix, tails, block_size,
                                                                          first_leaves, num_blocks) -> None:
    """Siblings with a common prefix: the later ones reference the first's full blocks (refcounts), prefill only
    the rest, and generate exactly what each generates alone. A small pool evicts cached blocks (never a
    referenced one) and the rows stay exact with whatever is left to share."""
    model = _model(name)
    kv = _kv(name, block_size, num_blocks)
    common = _prompt(99, prefix)
    prompts = [common + _prompt(50 + i, max(1, t) if prefix == 0 else t) for i, t in enumerate(tails)]
    n = 4
    rows: list[PagedRow] = []
    for i, prompt in enumerate(prompts):
        row = kv.join(prompt)
        assert row.tokens == list(prompt) and row.length <= len(prompt) - 1
        if i > 0 and num_blocks == 512:  # nothing evicted: every full block of the shared prefix is found
            shared = min(prefix, len(prompt) - 1, len(prompts[0])) // block_size * block_size
            assert row.cached_tokens >= shared
        if row.cached_tokens and rows and num_blocks == 512:  # the first sibling still reads its blocks
            assert kv.stats().shared >= 1
        try:
            out = [_prefill(kv, model, row, prompt, 64)]
            while len(out) < n:
                out.append(int(mx.argmax(kv.forward(model, [row], [[out[-1]]])[0, -1])))
        except PoolExhausted:
            kv.leave(row)  # the small pool holds all the live rows' blocks: this one cannot run now
            continue
        assert tuple(out) == _golden(name, prompt, n), (i, row.cached_tokens)
        if first_leaves:
            kv.leave(row)  # the next sibling finds the prefix in the cached (unreferenced) blocks
        else:
            rows.append(row)
        kv.pool.check()
    for row in rows:
        kv.leave(row)
    _assert_idle(kv)


def test_a_shared_prefix_is_prefilled_once_and_held_once() -> None:
    """Four siblings, 40 shared tokens, 8-token blocks: each later one prefills only its tail (and the partial block),
    and the shared blocks are held once however many rows read them."""
    model = _model("llama")
    kv = _kv("llama", 8)
    common = _prompt(7, 40)
    rows, fed = [], []
    for i in range(4):
        prompt = common + _prompt(60 + i, 6)
        row = kv.join(prompt)
        fed.append(len(prompt) - row.length)
        _prefill(kv, model, row, prompt, 64)
        rows.append(row)
    assert fed == [46, 6, 6, 6]
    assert all(r.blocks[:5] == rows[0].blocks[:5] for r in rows)
    assert kv.stats().used == 5 + 4 * 1 and kv.stats().shared == 5  # 5 shared blocks + each row's own 6-token block
    for row in rows:
        kv.leave(row)
    assert kv.stats().cached == 5  # the prefix stays cached (each row's partial block is freed)
    _assert_idle(kv)


def test_with_paged_kv_refuses_a_model_it_cannot_page_by_name_and_pages_one_it_can() -> None:
    """--kv-layout paged at load: a sliding-window model is refused with the reason (the server then refuses to start)."""
    from mlx_trio.engine.model.load import load_model, with_paged_kv
    from mlx_trio.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="--kv-layout paged cannot serve here: .*sliding-window"):
        with_paged_kv(load_model(str(tiny_model(LLAMA_SWA))), 1 << 20)
    paged = with_paged_kv(load_model(str(tiny_model(LLAMA))), 1 << 20).paged_kv
    assert paged is not None and paged.capacity_bytes <= 1 << 20 and paged.pool.idle
