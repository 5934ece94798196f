"""Prompt-cache reuse on the batch lane's engine objects: a hit gives exactly the tokens of a cold run.

Full attention (llama), sliding window crossing its ring (llama_swa, window
16) and hybrid recurrent (qwen3_next): a first request stores a boundary
snapshot and a finish-time entry; later requests that share the prefix start
from them and must decode the same greedy tokens as without any cache. The
entries themselves must never change when a hit's clone is written.
"""

from __future__ import annotations


import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_trio.engine.kv import cache_clone
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.prompt_cache.ram_tier import PromptCache
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model

from mlx_trio.testing import batch_reference as ref
from tests.engine.batch.batch_driver import token_ids

_MODELS = {}


def _model(name: str):
    if name not in _MODELS:
        if name == "qwen3_next":
            _MODELS[name] = (ref.tiny_qwen3_next(), 256)
        else:
            _MODELS[name] = (load(str(tiny_model({"llama": LLAMA, "llama_swa": LLAMA_SWA}[name])))[0], 512)
    return _MODELS[name]


def _prompt(seed: int, n: int, vocab: int) -> tuple[int, ...]:
    return tuple((seed * 7 + 13 * j) % (vocab - 3) + 3 for j in range(n))


def _run(model, prompt, n: int, cache: PromptCache | None, snapshot_at: int | None = None, step: int = 64):
    """Greedy-decode n tokens as the actors do; with a cache: look up, snapshot, finish-time put."""
    hit = cache.lookup(prompt) if cache is not None else None
    row = SoloRow(model, "r", prompt, SamplingParams(max_tokens=n), prefill_step_size=step, hit=hit,
                  snapshot_at=snapshot_at)
    while row.prefill_remaining:
        row.prefill_chunk()
        if cache is not None and row.fed == snapshot_at:
            cache.put(row.snapshot())
    tokens = [row.first_token()]
    batch = DecodeBatch(model)
    batch.join_many([(row, tokens[0])])
    while len(tokens) < n:
        out = token_ids(batch.step_decoded())
        if out is not None:
            tokens.extend(out)
    tokens = tokens[:n]
    batch.flush_decoded()
    if cache is not None:
        cache.put(batch.cache_entry("r", prompt + tuple(tokens)))
    batch.leave(["r"])
    return tokens, (hit.usable if hit is not None else 0)


@pytest.mark.parametrize("name", ["llama", "llama_swa", "qwen3_next"])
def test_shared_prefix_hits_and_decodes_exactly_the_uncached_tokens(name: str) -> None:
    model, vocab = _model(name)
    system = _prompt(1, 300, vocab)
    first, second, repeat = system + _prompt(2, 40, vocab), system + _prompt(3, 50, vocab), None
    cache = PromptCache(max_bytes=1 << 30, max_entries=16)
    cold_first, cached = _run(model, first, 12, cache, snapshot_at=len(system))
    assert cached == 0 and cold_first == _run(model, first, 12, None)[0]
    warm_second, cached = _run(model, second, 12, cache, snapshot_at=len(system))
    assert cached >= len(system)
    assert warm_second == _run(model, second, 12, None)[0]
    # The same conversation's next turn: prompt = first + its answer + more; the finish-time entry serves it.
    repeat = first + tuple(cold_first) + _prompt(4, 20, vocab)
    warm_repeat, cached = _run(model, repeat, 8, cache)
    assert cached >= len(first) + len(cold_first) - 1
    assert warm_repeat == _run(model, repeat, 8, None)[0]


def test_a_written_clone_never_changes_its_entry() -> None:
    model, vocab = _model("llama")
    prompt = _prompt(5, 100, vocab)
    cache = PromptCache(max_bytes=1 << 30, max_entries=4)
    _run(model, prompt, 6, cache)
    (entry,) = [cache.lookup(prompt + (9,)).entry]
    before = [mx.array(a) for c in entry.caches for a in c.state[:2]]
    mx.eval(before)
    taken = cache_clone.take(entry.caches, 50)  # trimmed: its next write lands inside the entry's buffer
    model(mx.array([_prompt(6, 30, vocab)]), cache=taken)
    mx.eval([c.state for c in taken])
    after = [a for c in entry.caches for a in c.state[:2]]
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, after))


def test_repeating_a_prompt_trims_the_finish_entry_on_full_attention() -> None:
    model, vocab = _model("llama")
    prompt = _prompt(7, 80, vocab)
    cache = PromptCache(max_bytes=1 << 30, max_entries=4)
    cold, _ = _run(model, prompt, 10, cache)
    warm, cached = _run(model, prompt, 10, cache)
    assert cached == len(prompt) - 1 and warm == cold
