"""--kv-layout paged: short prompts with no cached blocks prefill as cohorts (docs/design.md §6.5, issue #45).

A cohort runs on its rows' own caches and copies each row into fresh blocks in the same lease job
(engine/batch/cohort_prefill.py `prefill_rows_into`); a prompt that starts with cached blocks keeps the solo
paged path and computes only its tail. Tokens are exact against the padded engine and mlx-lm's `generate_step`
alone, and every block and pin is back once the requests end (the autouse leak fixture checks the pools).
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import mlx_lm
import trio
from mlx_lm.generate import generate_step

from mlx_trio import open_engine
from mlx_trio.actors import prefill as prefill_module
from mlx_trio.engine.batch.cohort_prefill import prefill_rows_into
from mlx_trio.supervision.faults import InjectedFault
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

MAX_TOKENS = 10
# Distinct short prompts (5-21 tokens, none a full block of another's start).
FRESH = [[(11 * i + 7 * j) % 250 + 20 + i for j in range(5 + 3 * i)] for i in range(6)]
BLOCK = 16
BUDGET = 16 << 20  # a small pool: the default budget takes most of the machine
PREFIX = [(5 * j + 1) % 200 + 30 for j in range(3 * BLOCK)]  # 3 full blocks, cached by a first request
SIBLING = PREFIX + [401, 402, 403]


def _reference(prompts: list[list[int]]) -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens from mlx-lm's `generate_step`, alone."""
    model, _ = mlx_lm.load(str(tiny_model(LLAMA)))
    return [tuple(int(token) for (token, _), _ in zip(generate_step(mx.array(p), model), range(MAX_TOKENS)))
            for p in prompts]


async def _wave(engine, prompts: list[list[int]]) -> tuple[list[tuple[int, ...]], list[Any]]:
    """Hold the lease until `prompts` all wait in admission's queue or at the prefill actor, so the prefill side
    sees them at once (a fixed hold was too short on a loaded box); their tokens and usages."""
    await engine.wait_ready()
    lane = engine.actors.lane
    admitted = lane.admission.statistics().admitted
    release = threading.Event()
    lane.lease.submit_nowait(release.wait, 30.0)
    out: list[tuple[int, ...]] = [()] * len(prompts)
    usage: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        completion = await engine.complete(prompts[i], max_tokens=MAX_TOKENS, temperature=0)
        out[i], usage[i] = completion.token_ids, completion.usage

    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
            with trio.move_on_after(10):
                while len(lane.admission.queued()) + lane.admission.statistics().admitted - admitted < len(prompts):
                    await trio.sleep(0.005)
            release.set()
    finally:
        release.set()
    return out, usage


async def _idle_pool(engine) -> None:
    with trio.fail_after(5):
        while engine.status()["counters"]["kv_blocks"]["used"] or engine.actors.lane.pins:
            await trio.sleep(0.01)
    assert engine.actors.lane.admission.statistics().reserved_bytes == 0


async def _padded(prompts: list[list[int]]) -> list[tuple[int, ...]]:
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="padded", kv_budget_bytes=BUDGET) as engine:
        return (await _wave(engine, prompts))[0]


async def test_short_fresh_prompts_arriving_together_prefill_as_cohorts_into_blocks_token_exact() -> None:
    expected = _reference(FRESH)
    assert await _padded(FRESH) == expected
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET) as engine:
        got, _ = await _wave(engine, FRESH)
        stats = engine.actors.lane.prefill.statistics()
        # One lease job for the cohort's rows instead of one (and a chunk job) each.
        assert stats.cohort_rows >= len(FRESH) - 1, stats
        assert got == expected
        await _idle_pool(engine)
        # The adopted rows' full blocks are keyed: a repeat of the longest prompt finds them.
        again = await engine.complete(FRESH[-1], max_tokens=MAX_TOKENS, temperature=0)
        assert again.token_ids == expected[-1]
        assert again.usage.cached_tokens == (len(FRESH[-1]) - 1) // BLOCK * BLOCK > 0
        await _idle_pool(engine)


async def test_a_sibling_of_a_cached_prefix_prefills_its_tail_alone_while_fresh_prompts_cohort() -> None:
    # The sibling last: its admission pins its cached prefix in a lease job, which waits behind the held lease;
    # first in the wave, it held the fresh ones in admission's queue until the lease was free, and under load
    # the prefill actor could then take them one at a time.
    wave = [*FRESH[:4], SIBLING]
    expected = _reference(wave)
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET) as engine:
        first = await engine.complete(PREFIX + [7], max_tokens=2, temperature=0)  # caches the prefix's 3 blocks
        assert first.usage.cached_tokens == 0
        await _idle_pool(engine)
        before = engine.actors.lane.prefill.statistics()
        got, usage = await _wave(engine, wave)
        after = engine.actors.lane.prefill.statistics()
        assert got == expected
        assert usage[-1].cached_tokens == len(PREFIX)  # the sibling computed only its tail
        assert [u.cached_tokens for u in usage[:-1]] == [0] * 4
        assert after.cohort_rows - before.cohort_rows >= 3  # the fresh ones (all but one at most) as a cohort
        await _idle_pool(engine)


async def test_a_fault_in_a_cohort_job_resumes_every_stream_token_exact_and_frees_every_block(monkeypatch) -> None:
    """The cohort's lease job raises (an injected crash): the prefill actor restarts, the requests resume and
    prefill again, and no block stays referenced."""
    expected = _reference(FRESH)
    fired: list[int] = []

    def crashing(paged, model, makers):
        if len(makers) > 1 and not fired:
            fired.append(len(makers))
            raise InjectedFault("injected: a cohort's prefill job")
        return prefill_rows_into(paged, model, makers)

    monkeypatch.setattr(prefill_module, "prefill_rows_into", crashing)
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET) as engine:
        got, _ = await _wave(engine, FRESH)
        assert fired, "no cohort job ran"
        assert got == expected
        await _idle_pool(engine)


async def test_siblings_of_one_uncached_prefix_in_a_wave_compute_it_once_beside_a_cohort() -> None:
    """Prompts sharing a first block with a request already in the cohort are left out of it: each would compute
    the prefix and hold a copy. The first computes it, the others take its blocks and compute their tails."""
    siblings = [PREFIX + [401 + i, 402 + i] for i in range(3)]
    wave = [*siblings, *FRESH[:3]]
    expected = _reference(wave)
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET) as engine:
        got, usage = await _wave(engine, wave)
        assert got == expected
        assert sorted(u.cached_tokens for u in usage[:3]) == [0, len(PREFIX), len(PREFIX)]
        assert [u.cached_tokens for u in usage[3:]] == [0] * 3
        assert engine.actors.lane.prefill.statistics().cohort_rows >= 2
        await _idle_pool(engine)
