"""The decode batch on paged KV (`DecodeBatch(paged=...)`): the same tokens as today's padded layout and as each row
alone, joins and leaves that move no other row's KV, the bytes of the tokens held, and the pool idle after.

The rows prefill alone as today (SoloRow); a join copies the joiner's own KV into blocks. The padded layout's
replay is the reference (it equals mlx-lm's own batch, tests/engine/batch/test_batch_dynamic.py); logits agree
to float32 summation order (the paged attention sums over each row's own keys), tokens exactly.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load

from mlx_trio.engine.attention import paged_layout, routed_attention
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.blocks.pool import PoolExhausted
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.params import SamplingParams
from mlx_trio.testing import batch_reference as ref
from mlx_trio.testing.batch_reference import Arrival
from mlx_trio.testing.tiny_models import LLAMA, QWEN3, tiny_model

SPECS = {"llama": LLAMA, "qwen3": QWEN3}
SCHEDULE = [(0, 60, 20), (1, 3, 15), (2, 150, 10), (4, 7, 12), (6, 33, 9), (9, 1, 14), (11, 90, 6), (12, 12, 18)]


@cache
def _model(name: str) -> Any:
    model = load(str(tiny_model(SPECS[name])))[0]
    routed_attention.install(model)  # route unset on the CPU: the padded path is mlx-lm's own attention
    return model


def _kv(name: str, block_size: int, num_blocks: int = 1024) -> PagedKV:
    model = _model(name)
    budget = num_blocks * paged_layout.BlockStorage.block_bytes(paged_layout.layer_shapes(model), block_size,
                                                                 mx.float32)
    return paged_layout.paged_kv_for(model, budget, f"tiny-{name}", block_size=block_size)


def _arrivals(schedule: list[tuple[int, int, int]]) -> list[ref.Arrival]:
    return [ref.Arrival(f"r{i}", at, tuple((11 * i + 5 * j + j * j) % 509 + 3 for j in range(n)),
                        SamplingParams(max_tokens=m)) for i, (at, n, m) in enumerate(schedule)]


def _paged_engine(model: Any, kv: PagedKV) -> tuple[Any, DecodeBatch, ref.RecordingModel]:
    make_row, _, recorder = ref.ours(model, prefill_step_size=8)
    return make_row, DecodeBatch(recorder, paged=kv), recorder


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_batch_equals_the_padded_batch(name: str, block_size: int) -> None:
    model = _model(name)
    kv = _kv(name, block_size)
    arrivals = _arrivals(SCHEDULE)
    got = ref.run_schedule(_paged_engine(model, kv), arrivals, eos=(), max_batch=8)
    want = ref.run_schedule(ref.ours(model, prefill_step_size=8), arrivals, eos=(), max_batch=8)
    assert got.tokens == want.tokens
    diffs = ref.logit_diffs(got, want)
    assert diffs and max(diffs.values()) < 1e-4
    assert got.final_nbytes == 0
    kv.pool.check()
    assert kv.pool.idle


@settings(max_examples=8)
@given(name=st.sampled_from(list(SPECS)), block_size=st.sampled_from([1, 4, 16]),
       schedule=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 50), st.integers(1, 10)), min_size=1,
                         max_size=6))
def test_paged_batch_joins_and_leaves_equal_the_padded_batch(name, block_size, schedule) -> None:
    model = _model(name)
    kv = _kv(name, block_size)
    moved: list[str] = []

    def no_kv_moved(_: int, batch: DecodeBatch) -> None:
        """Every row's blocks are the ones it had, with the same content, whatever joined or left since."""
        for rid, row in zip(batch.request_ids, batch._paged_rows):
            blocks = list(row.blocks)
            content = mx.stack([kv.storage.keys[0][mx.array(blocks)], kv.storage.values[-1][mx.array(blocks)]])
            mx.eval(content)
            seen = snapshots.get(rid)
            if seen is not None:
                old_blocks, old = seen
                n = len(old_blocks) - 1  # the last block was still being written
                if blocks[:n] != old_blocks[:n] or not mx.array_equal(content[:, :n], old[:, :n]).item():
                    moved.append(rid)
            snapshots[rid] = (blocks, content)

    snapshots: dict[str, Any] = {}
    arrivals = _arrivals(schedule)
    got = ref.run_schedule(_paged_engine(model, kv), arrivals, eos=(), max_batch=4, on_step=no_kv_moved)
    want = ref.run_schedule(ref.ours(model, prefill_step_size=8), arrivals, eos=(), max_batch=4)
    assert got.tokens == want.tokens
    assert not moved
    kv.pool.check()
    assert kv.pool.idle


def test_paged_batch_holds_the_bytes_of_its_tokens_where_the_padded_one_holds_the_longest_row_times_b() -> None:
    """One 300-token row beside 7 short rows: paged bytes are within one block a row of the tokens held."""
    model = _model("llama")
    kv = _kv("llama", 16)
    bytes_per_token = kv.storage.bytes_per_block // 16
    for paged in (kv, None):
        batch = DecodeBatch(model, paged=paged)
        lengths = [300] + [5] * 7
        for i, n in enumerate(lengths):
            row = SoloRow(model, f"r{i}", [(3 * i + j) % 500 + 3 for j in range(n)], SamplingParams(max_tokens=50))
            while row.prefill_chunk():
                pass
            batch.join_many([(row, row.first_token())])
        for _ in range(4):
            batch.step_decoded()
        batch.flush_decoded()
        held = sum(batch.num_fed(rid) for rid in batch.request_ids) * bytes_per_token
        if paged is not None:
            assert held <= batch.nbytes <= held + len(lengths) * kv.storage.bytes_per_block
        else:
            assert batch.nbytes >= 2 * held  # padded to the longest row (the ratio the paged layout removes)
        batch.close()
    assert kv.pool.idle


def test_a_cache_entry_from_a_paged_row_is_the_rows_kv() -> None:
    model = _model("llama")
    kv = _kv("llama", 4)
    entries = {}
    for paged in (kv, None):
        batch = DecodeBatch(model, paged=paged)
        for i, n in enumerate((9, 23)):
            row = SoloRow(model, f"r{i}", [(5 * i + j) % 500 + 3 for j in range(n)], SamplingParams(max_tokens=50))
            while row.prefill_chunk():
                pass
            batch.join_many([(row, row.first_token())])
        decoded = [batch.step_decoded() for _ in range(3)]
        batch.flush_decoded()
        n_fed = batch.num_fed("r1")
        entries[paged is None] = batch.cache_entry("r1", tuple(range(n_fed)))
        batch.close()
    paged_entry, padded_entry = entries[False], entries[True]
    assert paged_entry is not None and padded_entry is not None
    assert decoded is not None
    for a, b in zip(paged_entry.caches, padded_entry.caches):  # same positions, same KV
        assert a.offset == b.offset
        assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], atol=1e-5).item()
    assert kv.pool.idle


def test_features_not_on_the_paged_layout_are_refused_by_name() -> None:
    model = _model("llama")
    kv = _kv("llama", 16)
    with pytest.raises(ValueError, match="quantized KV"):
        DecodeBatch(model, KvScheme(bits=8), paged=kv)
    with pytest.raises(ValueError, match="quantized KV"):
        SoloRow(model, "r", [3, 4, 5], SamplingParams(), kv_scheme=KvScheme(bits=8), paged=kv)
    with pytest.raises(ValueError, match="snapshot"):
        SoloRow(model, "r", [3, 4, 5], SamplingParams(), snapshot_at=2, paged=kv)
    assert kv.pool.idle


def test_a_join_the_pool_cannot_hold_leaves_the_batch_unchanged() -> None:
    model = _model("llama")
    kv = _kv("llama", 4, num_blocks=5)
    batch = DecodeBatch(model, paged=kv)
    rows = []
    for i, n in enumerate((10, 10)):  # 3 blocks each (4-token blocks): the second does not fit in the 2 left
        row = SoloRow(model, f"r{i}", [(5 * i + j) % 500 + 3 for j in range(n)], SamplingParams(max_tokens=50))
        while row.prefill_chunk():
            pass
        rows.append((row, row.first_token()))
    batch.join_many([rows[0]])
    batch.step_decoded()
    batch.flush_decoded()
    used = kv.stats().used
    with pytest.raises(PoolExhausted):
        batch.join_many([rows[1]])
    assert batch.request_ids == ["r0"] and kv.stats().used == used
    batch.close()
    rows[1][0].close()
    assert kv.pool.idle


def _paged_rows_engine(model: Any, kv: PagedKV, made: list[SoloRow]) -> tuple[Any, DecodeBatch, ref.RecordingModel]:
    """SoloRows that prefill into the pool (sharing cached prefix blocks) and a paged batch that takes them as they are."""
    recorder = ref.RecordingModel(model)

    def make_row(a: ref.Arrival) -> SoloRow:
        row = SoloRow(recorder, a.request_id, a.prompt_ids, a.params, prefill_step_size=8, paged=kv)
        made.append(row)
        return row
    return make_row, DecodeBatch(recorder, paged=kv), recorder


@settings(max_examples=8)
@given(name=st.sampled_from(list(SPECS)), block_size=st.sampled_from([1, 4, 16]), prefix=st.integers(0, 70),
       tails=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 20), st.integers(1, 8)), min_size=1, max_size=6))
def test_rows_prefilled_into_the_pool_share_prefixes_and_equal_the_padded_batch(name, block_size, prefix,
                                                                                tails) -> None:
    """Rows with a common prefix prefill only what the pool does not hold yet, join without a copy, and
    generate exactly the tokens of the same schedule on today's layout."""
    model = _model(name)
    kv = _kv(name, block_size)
    common = tuple((7 * j + 1) % 509 + 3 for j in range(prefix))
    arrivals = [ref.Arrival(f"r{i}", at, common + tuple((11 * i + 5 * j + j * j) % 509 + 3 for j in range(n)),
                            SamplingParams(max_tokens=m)) for i, (at, n, m) in enumerate(tails)]
    made: list[SoloRow] = []
    got = ref.run_schedule(_paged_rows_engine(model, kv, made), arrivals, eos=(), max_batch=4)
    want = ref.run_schedule(ref.ours(model, prefill_step_size=8), arrivals, eos=(), max_batch=4)
    assert got.tokens == want.tokens
    assert made[0].cached_tokens == 0
    shared = prefix // block_size * block_size
    assert all(row.cached_tokens >= min(shared, len(row.prompt_ids) - 1) // block_size * block_size
               for row in made[1:])
    kv.pool.check()
    assert kv.pool.idle


def test_a_row_prefilled_into_the_pool_joins_without_a_copy() -> None:
    model = _model("llama")
    kv = _kv("llama", 4)
    batch = DecodeBatch(model, paged=kv)
    row = SoloRow(model, "r0", list(range(3, 30)), SamplingParams(max_tokens=50), paged=kv)
    while row.prefill_chunk():
        pass
    token0 = row.first_token()
    blocks = list(row.paged_row.blocks)
    used = kv.stats().used
    batch.join_many([(row, token0)])
    assert batch._paged_rows[0].blocks == blocks and kv.stats().used == used  # the same blocks, none new
    row.close()  # the batch owns the blocks now: closing the solo row releases nothing
    assert kv.stats().used == used
    batch.close()
    assert kv.pool.idle


def test_eight_siblings_prefill_the_shared_prefix_once() -> None:
    """The issue's CPU measure at small scale: 8 rows, a 200-token shared prefix, distinct 16-token tails, arriving
    one after another: the prefill computes the prefix once (each later row only its tail and the partial block)."""
    model = _model("llama")
    kv = _kv("llama", 16)
    common = [(7 * j + 1) % 509 + 3 for j in range(200)]
    rows = []
    for i in range(8):
        row = SoloRow(model, f"r{i}", common + [(11 * i + j) % 509 + 3 for j in range(16)], SamplingParams(), paged=kv)
        while row.prefill_chunk():
            pass
        row.first_token()
        rows.append(row)
    computed = sum(len(row.prompt_ids) - row.cached_tokens for row in rows)
    assert computed == 216 + 7 * (216 - 192)  # 192 = the 12 full blocks of the prefix
    assert kv.stats().shared == 12
    for row in rows:
        row.close()
    assert kv.pool.idle


def test_speculative_steps_on_paged_kv_keep_every_rows_tokens_and_kv() -> None:
    """Random proposals (accepted, rejected, none) over joins and leaves: each row's rejected tail is truncated
    off its blocks, and tokens and KV equal the plain run on today's layout; prompt lookup too."""
    from tests.engine.batch.batch_driver import run_schedule
    from tests.engine.speculative.test_verification import SCHEDULE as SPEC_SCHEDULE
    from tests.engine.speculative.test_verification import _arrivals as spec_arrivals
    from tests.engine.speculative.test_verification import _assert_same_kv, _oracle, _tokens

    model = _model("llama")
    arrivals = spec_arrivals(SPEC_SCHEDULE)
    plain_kv: dict[str, Any] = {}
    plain = run_schedule(model, arrivals, eos=(), entries=plain_kv)
    for block_size, speculation in ((4, _oracle(plain, arrivals, 0)), (1, _oracle(plain, arrivals, 1)),
                                    (16, SpeculationConfig.prompt_lookup(3, 3))):
        kv = _kv("llama", block_size)
        entries: dict[str, Any] = {}
        got = run_schedule(model, arrivals, eos=(), speculation=speculation, entries=entries, paged=kv)
        assert _tokens(got) == _tokens(plain)
        _assert_same_kv(entries, plain_kv)
        kv.pool.check()
        assert kv.pool.idle


def test_truncating_into_a_shared_block_copies_it_first() -> None:
    """A row rolled back into a block another row reads gets its own copy; the reader's KV is untouched."""
    model = _model("llama")
    kv = _kv("llama", 4)
    prompt = tuple(range(3, 14))  # 11 tokens: blocks of 4, 4, 3
    a = kv.join(prompt)
    kv.forward(model, [a], [prompt])
    b = kv.join(prompt + (20, 21))  # shares a's two full blocks
    assert b.blocks == a.blocks[:2] and b.length == 8
    before = mx.array(kv.storage.keys[0][mx.array(a.blocks[:2])])
    mx.eval(before)
    kv.truncate(b, 2)  # into the second shared block
    assert b.length == 6 and b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert mx.array_equal(kv.storage.keys[0][b.blocks[1], :2], kv.storage.keys[0][a.blocks[1], :2]).item()
    kv.forward(model, [b], [(30, 31, 32)])  # b writes its own block; a's stays as it was
    assert mx.array_equal(kv.storage.keys[0][mx.array(a.blocks[:2])], before).item()
    kv.leave(a)
    kv.leave(b)
    kv.pool.check()
    assert kv.pool.idle


def test_grammar_logprob_and_sampled_rows_on_paged_kv_equal_todays_layout() -> None:
    """Constrained (JSON schema), seeded, penalised and logprob rows joining and leaving: the same tokens and
    logprobs on paged KV as on today's layout (sampling sees only logits; the layout only where KV lives)."""
    import json

    from mlx_trio.engine.sampling.grammar import build_grammar_tokenizer
    from mlx_trio.params import Constraint
    from tests.engine.batch.batch_driver import Arrival, run_schedule

    model, tokenizer = load(str(tiny_model(LLAMA)))
    routed_attention.install(model)
    grammar = build_grammar_tokenizer(tokenizer, tokenizer.eos_token_ids)
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 30}},
              "required": ["id"], "additionalProperties": False}
    options = [dict(max_tokens=24, constraint=Constraint("json_schema", json.dumps(schema))),
               dict(max_tokens=14, temperature=0.8, top_p=0.9, seed=5, logprobs=True, top_logprobs=2),
               dict(max_tokens=12, repetition_penalty=1.3, logit_bias=((7, 2.0),)),
               dict(max_tokens=10, temperature=1.1, seed=9, top_k=20, presence_penalty=0.4)]
    arrivals = [Arrival(f"r{i}", 2 * i, tuple((13 * i + 7 * j + j * j) % 500 + 3 for j in range(5 + 6 * i)),
                        SamplingParams(**o)) for i, o in enumerate(options)]
    eos = set(tokenizer.eos_token_ids)
    want = run_schedule(model, arrivals, eos=eos, grammar_tokenizer=grammar)
    kv = paged_layout.paged_kv_for(model, 1 << 22, "tiny-llama", block_size=4)
    got = run_schedule(model, arrivals, eos=eos, grammar_tokenizer=grammar, paged=kv)
    for a in arrivals:
        g, w = got[a.request_id], want[a.request_id]
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason, a.request_id
        for gl, wl in zip(g.logprobs, w.logprobs):
            assert (gl is None) == (wl is None)
            if gl is not None:
                assert gl.top[0][0] == wl.top[0][0] and abs(gl.logprob - wl.logprob) < 1e-4
    assert got["r0"].finish_reason == "stop"
    assert kv.pool.idle


@pytest.mark.parametrize("block_size", [4, 16])
def test_siblings_prefilling_side_by_side_compute_the_shared_prefix_about_once(block_size: int) -> None:
    """8 rows with a 200-token common prefix start together and prefill in interleaved chunks (as the prefill actor
    runs concurrent prompts): each chunk first takes the blocks the others cached meanwhile, so the prefix is
    computed about once; every row's token 0 equals its own alone."""
    model = _model("llama")
    kv = _kv("llama", block_size)
    common = [(7 * j + 1) % 509 + 3 for j in range(200)]
    prompts = [common + [(11 * i + j) % 509 + 3 for j in range(16)] for i in range(8)]
    rows = [SoloRow(model, f"r{i}", p, SamplingParams(), paged=kv) for i, p in enumerate(prompts)]
    chunks = 0
    while any(row.prefill_remaining for row in rows):
        for row in rows:
            if row.prefill_remaining:
                row.prefill_chunk(24)
                chunks += 1
    token0 = [row.first_token() for row in rows]
    computed = sum(len(row.prompt_ids) - row.cached_tokens for row in rows)
    assert computed <= 1.3 * (200 + 8 * 16), computed
    alone = []
    for p in prompts:
        solo = SoloRow(model, "alone", p, SamplingParams())
        while solo.prefill_chunk():
            pass
        alone.append(solo.first_token())
        solo.close()
    assert token0 == alone
    for row in rows:
        row.close()
    kv.pool.check()
    assert kv.pool.idle


def test_adapter_rows_on_paged_kv_equal_mlx_lm_and_never_share_another_revisions_blocks() -> None:
    """Base and adapter rows with one prompt prefix, batched with joins and leaves on paged KV: each row equals
    mlx-lm with its adapter; a row shares blocks only with rows of its own adapter revision."""
    from mlx_trio.engine.adapters.adapter_files import read_adapter
    from mlx_trio.engine.adapters.resident import ResidentAdapters
    from tests.engine.adapters.test_row_lora import MAX_TOKENS, _adapter_dir, _mlx_lm_tokens
    from tests.engine.batch.batch_driver import run_schedule

    model, tokenizer = load(str(tiny_model(LLAMA)))
    routed_attention.install(model)
    resident = ResidentAdapters(model)
    for name in ("qv", "dora"):
        resident.register(read_adapter(name, _adapter_dir("llama", name), model, max_rank=resident.max_rank))
    kv = paged_layout.paged_kv_for(model, 1 << 22, "tiny-llama", block_size=4)
    common = tuple((7 * j + 2) % 500 + 3 for j in range(24))
    plan = [("qv", 0), (None, 0), ("dora", 2), ("qv", 4), (None, 5), ("dora", 6)]
    arrivals = [Arrival(f"r{i}", at, common + (100 + i, 200 + i), SamplingParams(max_tokens=MAX_TOKENS))
                for i, (_, at) in enumerate(plan)]
    adapter_of = {f"r{i}": name for i, (name, _) in enumerate(plan)}
    made: dict[str, int] = {}
    join = kv.join

    # What each row found cached (a spy, not a patch of mlx-lm).
    def counting_join(prompt, adapter_revision="", pin=None):
        row = join(prompt, adapter_revision, pin=pin)
        made[adapter_revision.split("@")[0] or "base"] = made.get(adapter_revision.split("@")[0] or "base", 0) + (
            row.cached_tokens > 0)
        return row

    kv.join = counting_join  # type: ignore[method-assign]
    out = run_schedule(model, arrivals, eos=tokenizer.eos_token_ids, paged=kv,
                       adapter_of=lambda rid: resident.acquire(adapter_of[rid]) if adapter_of[rid] else None)
    for a in arrivals:
        assert tuple(out[a.request_id].tokens) == _mlx_lm_tokens("llama", adapter_of[a.request_id], a.prompt_ids), \
            a.request_id
    assert made == {"qv": 1, "base": 1, "dora": 1}  # the second row of each revision shares; no first one does
    assert kv.pool.idle and not resident.in_use("qv")


def test_warm_up_on_paged_kv_leaves_the_pool_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-layout paged warms the paged path (prefill into blocks, steps over tables); every block goes back."""
    from mlx_trio.engine.batch.warmup import warm_up

    model = _model("llama")
    kv = _kv("llama", 16)
    joined: list[int] = []
    join_many = DecodeBatch.join_many

    def counting(self: DecodeBatch, joiners: Any) -> None:  # a spy on our own class: how many rows joined
        joined.append(len(joiners))
        join_many(self, joiners)

    monkeypatch.setattr(DecodeBatch, "join_many", counting)
    warm_up(model, 512, paged=kv)
    monkeypatch.undo()
    assert sum(joined) == 3  # every warm-up row decoded in the paged batch
    warm_up(model, 512, speculation=SpeculationConfig.prompt_lookup(3, 3), paged=kv)
    kv.pool.check()
    assert kv.pool.idle and kv.stats().cached > 0


def test_the_lean_decode_forward_runs_on_paged_kv() -> None:
    """A fused model steps through the lean forward (engine/model/decode_forward.py) on block tables too."""
    from mlx_trio.engine.model import fused_projections
    from mlx_trio.engine.model.decode_forward import DecodeForward

    model = load(str(tiny_model(LLAMA)))[0]
    routed_attention.install(model)
    fused_projections.fuse(model)
    assert DecodeForward.of(model) is not None
    from tests.engine.batch.batch_driver import run_schedule

    kv = paged_layout.paged_kv_for(model, 1 << 22, "tiny-llama-fused", block_size=8)
    assert DecodeBatch(model, paged=kv)._lean is not None
    arrivals = _arrivals(SCHEDULE)
    got = run_schedule(model, arrivals, eos=(), paged=kv)  # DecodeBatch(model): the lean forward, not a wrapper
    want = run_schedule(_model("llama"), arrivals, eos=())
    assert {rid: o.tokens for rid, o in got.items()} == {rid: o.tokens for rid, o in want.items()}
    assert kv.pool.idle
