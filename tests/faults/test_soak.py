"""Soak (slow tier): 64 clients for 30 s while a random actor is killed every second."""

from __future__ import annotations

import random
import resource

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [f"Item {i} is a small note about the sea" for i in range(8)]
VICTIMS = ["decode-step", "prefill", "admission", "gpu-lease", "session"]


async def test_soak_random_kills_lose_and_corrupt_nothing() -> None:
    """Every response equals its undisturbed greedy run; kv_bytes ends at 0; RSS stays bounded."""
    path = str(tiny_model(LLAMA))
    async with open_engine(path, batch=1) as solo:
        expected = [(await solo.complete(p, max_tokens=16)).token_ids for p in PROMPTS]
    rng = random.Random(1)
    done = wrong = 0
    async with open_engine(path, batch=8, max_restarts=10_000, restart_period_s=1.0) as engine:
        rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        async def client(i: int, deadline: float) -> None:
            nonlocal done, wrong
            while trio.current_time() < deadline:
                k = (i + done) % len(PROMPTS)
                got = (await engine.complete(PROMPTS[k], max_tokens=16)).token_ids
                done += 1
                wrong += got != expected[k]

        async def killer(deadline: float) -> None:
            while trio.current_time() < deadline:
                await trio.sleep(1.0)
                engine.faults.arm(rng.choice(VICTIMS), "raise")

        deadline = trio.current_time() + 30
        async with trio.open_nursery() as nursery:
            nursery.start_soon(killer, deadline)
            for i in range(64):
                nursery.start_soon(client, i, deadline)
        with trio.fail_after(20):
            while engine.status()["counters"]["kv_bytes"] or not engine.health()[0]:
                await trio.sleep(0.05)
        rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert done > 64 and wrong == 0
    assert len(engine.faults.fired) >= 10
    assert rss_end < rss_start * 2
