"""The prompt cache through the embeddable API on the batch lane: hits, exact tokens, one shared prefill, one ceiling."""

from __future__ import annotations

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.events import Finished
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model
from tests.prompts import run_to_end

SYSTEM = "You are a careful agent. Read the sea story and answer in plain words. " * 30


def _chat(task: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


@pytest.mark.parametrize("spec", [LLAMA, LLAMA_SWA], ids=["full", "rotating"])
async def test_a_shared_system_prompt_is_served_from_the_cache_with_identical_tokens(spec) -> None:
    tasks = ["Tell me about the ship.", "What is the capital of the sea?", "Tell me about the ship and the shore."]
    async with open_engine(str(tiny_model(spec)), batch=4, prompt_cache_bytes=0) as engine:
        assert engine.status()["prompt_cache"]["enabled"] is False
        uncached = [await run_to_end(engine, _chat(task)) for task in tasks]
        assert all(finished.usage.cached_tokens == 0 for _, finished in uncached)
    async with open_engine(str(tiny_model(spec)), batch=4) as engine:
        boundary = engine.prepare(_chat(tasks[0])).snapshot_at
        assert boundary is not None and boundary > 500  # the system prompt's tokens
        cached = [await run_to_end(engine, _chat(task)) for task in tasks]
        stats = engine.status()["prompt_cache"]
    assert [ids for ids, _ in cached] == [ids for ids, _ in uncached]
    assert cached[0][1].usage.cached_tokens == 0
    assert all(finished.usage.cached_tokens >= boundary for _, finished in cached[1:])
    assert stats["enabled"] and stats["hits"] >= 2 and stats["snapshots"] >= 1 and stats["entries"] >= 1


async def test_eight_concurrent_requests_prefill_the_shared_system_prompt_once() -> None:
    tasks = [f"Question {chr(65 + i)}: tell me about item {i} of the sea." for i in range(8)]
    results: dict[int, Finished] = {}
    async with open_engine(str(tiny_model(LLAMA)), batch=8) as engine:
        boundary = engine.prepare(_chat(tasks[0])).snapshot_at
        lengths = [len(engine.prepare(_chat(task)).prompt_ids) for task in tasks]

        async def one(i: int) -> None:
            results[i] = (await run_to_end(engine, _chat(tasks[i]), max_tokens=4))[1]

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        prefilled = engine.actors.lane.prefill.statistics().prefill_tokens
    cached = sorted(f.usage.cached_tokens for f in results.values())
    assert cached[0] == 0 and all(c >= boundary for c in cached[1:])
    # Every prompt token but each prompt's last (the first decode step's input) was either
    # prefilled or cached: the system prompt was prefilled exactly once.
    assert prefilled == sum(n - 1 for n in lengths) - sum(cached)
    assert prefilled <= boundary + sum(n - 1 - boundary for n in lengths)


async def test_the_cache_gives_way_when_live_rows_need_the_bytes() -> None:
    path = str(tiny_model(LLAMA))
    chats = [[{"role": "system", "content": f"Variant {i}. " + SYSTEM}, {"role": "user", "content": "Go."}]
             for i in range(4)]
    async with open_engine(path, batch=2) as probe:
        layout = probe.model.kv_layout
        need = max(layout.request_bytes(len(probe.prepare(chat).prompt_ids), 8, 2048) for chat in chats)
        entry = layout.row_bytes(1280)  # one finished row's entry: its KV in 256-token buffer steps
    # Room for one long row and about one entry: the cache must make way for the next row.
    budget = need + int(entry * 1.5)
    async with open_engine(path, batch=2, kv_budget_bytes=budget, prompt_cache_bytes=budget) as engine:
        for chat in chats:
            ids, finished = await run_to_end(engine, chat)
            assert finished.finish_reason in ("stop", "length")
            assert engine.actors.lane.caching.nbytes + engine.actors.lane.admission.statistics().reserved_bytes <= budget
        stats = engine.status()["prompt_cache"]
    assert stats["evictions"] >= 1 and stats["bytes"] <= budget


def _break_head_dim(caches: list) -> None:
    """Lease thread: cut the head_dim of every full-attention layer's KV in place (an entry that cannot be used)."""
    for cache in caches:
        cache.keys = cache.keys[..., : cache.keys.shape[-1] // 2]
        cache.values = cache.values[..., : cache.values.shape[-1] // 2]


async def test_a_ram_entry_whose_row_fails_is_dropped_and_its_requests_run_uncached() -> None:
    """A RAM entry that breaks the row started from it: that request resumes uncached with its exact tokens
    instead of failing on it four times (a 503), the entry is gone and counted, the next one runs too."""
    tasks = ["Tell me about the ship.", "What is the capital of the sea?"]
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prompt_cache_bytes=0) as engine:
        uncached = [(await run_to_end(engine, _chat(task)))[0] for task in tasks]
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        first, _ = await run_to_end(engine, _chat(tasks[0]))
        caching = engine.actors.lane.caching
        with trio.fail_after(10):
            while caching.cache.pending:  # the first row's finish-time put is in
                await trio.sleep(0.01)
        entries = list(caching.cache._lru.values())
        assert entries
        for entry in entries:
            await engine.actors.lane.lease.run(_break_head_dim, entry.caches)
        second, _ = await run_to_end(engine, _chat(tasks[1]))
        third, _ = await run_to_end(engine, _chat(tasks[1]))
        stats = engine.status()["prompt_cache"]
    assert [first, second] == uncached and third == second
    assert stats["restore_failures"] >= 1 and all(entry.tokens not in caching.cache for entry in entries)
