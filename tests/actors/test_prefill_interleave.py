"""No head-of-line blocking in prefill, and a dropped prompt stops at the next chunk (issue #19, points 2-4).

On the tiny model (CPU), with a 20k-token prompt prefilling (6k in the default tier): a short request
gets its token 0 within two of the long prompt's chunks and the long one
still finishes; a long prompt dropped mid-prefill runs at most the chunk in
flight, its KV and reservation are freed, and a request behind it starts at
once. Counted in chunks (`PrefillStatistics.chunks`), never in seconds.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import attrs
import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.engine.batch.chunked_prefill import ChunkedPrefill
from mlx_trio.events import Finished, PromptProgress, TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

LONG_LLAMA = attrs.evolve(LLAMA, max_position_embeddings=32768)

def _long(n: int) -> list[int]:
    return [3 + (31 * i) % 500 for i in range(n)]


LONG = _long(6_000)
SHORT = [3 + (7 * i) % 500 for i in range(40)]
STEP = 512
WAIT_S = 600.0  # only reached when a test fails


async def _wait_for_chunks(engine: Any, n: int) -> None:
    prefill = engine.actors.lane.prefill
    with trio.fail_after(WAIT_S):
        while prefill.statistics().chunks < n:
            await trio.sleep(0.01)


@pytest.mark.parametrize("length", [6_000, pytest.param(20_000, marks=pytest.mark.slow)])
async def test_a_short_request_is_not_held_behind_a_long_prefill_and_the_long_one_finishes(length: int) -> None:
    """The issue's 20k-token prompt takes ~1.5 min on a busy 2-core CPU: the slow tier; 6k by default."""
    long_prompt = _long(length)
    async with open_engine(str(tiny_model(LONG_LLAMA)), batch=4, prefill_step_size=STEP) as engine:
        prefill = engine.actors.lane.prefill
        long_done: list[Finished] = []
        long_chunks = [0]  # the long prompt's chunks its session has seen

        async def long() -> None:
            async for event in engine.generate(long_prompt, max_tokens=2):
                if isinstance(event, PromptProgress) and event.processed:
                    long_chunks[0] += 1
                if isinstance(event, Finished):
                    long_done.append(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long)
            await _wait_for_chunks(engine, 2)  # the long prompt is well under way
            sent_at = long_chunks[0]
            async for event in engine.generate(SHORT, max_tokens=2):
                if isinstance(event, TextDelta) and event.token_ids:
                    first_at = long_chunks[0]
                    break
            assert prefill.statistics().prefilling == 1  # the long one goes on
        # The long prompt's chunk in flight when the short one came, and at most one more
        # (its session may relay one chunk late).
        assert first_at - sent_at <= 2
        assert long_done and long_done[0].usage.prompt_tokens == length
        stats = prefill.statistics()
        assert stats.cancelled == 0 and stats.sized_chunks < stats.chunks  # alone, the long one ran full chunks


def _slowed_chunks(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every prefill chunk takes `seconds` longer on the lease thread: a slow device, as the engine sees it."""
    chunk = ChunkedPrefill.chunk

    def slow(self: ChunkedPrefill, limit: int | None = None, *, evaluate: bool = True) -> Any:
        time.sleep(seconds)
        return chunk(self, limit, evaluate=evaluate)

    monkeypatch.setattr(ChunkedPrefill, "chunk", slow)


@pytest.mark.parametrize("slowed", [False, True], ids=["cpu", "slowed-step"])
async def test_a_prompt_dropped_mid_prefill_stops_at_the_next_chunk_and_frees_its_kv(
        slowed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted in chunks; with every chunk slowed by 0.3 s the count must be the same (nothing waits for time)."""
    if slowed:
        _slowed_chunks(monkeypatch, 0.3)
    async with open_engine(str(tiny_model(LONG_LLAMA)), batch=4, prefill_step_size=STEP) as engine:
        lane = engine.actors.lane
        prefill = lane.prefill
        async with contextlib.aclosing(engine.generate(LONG, max_tokens=2)) as events:
            async for event in events:
                if isinstance(event, PromptProgress) and event.processed >= 2048:
                    break  # the client gives up mid-prefill
        dropped_at = prefill.statistics().chunks
        with trio.fail_after(WAIT_S):
            while prefill.statistics().cancelled < 1:
                await trio.sleep(0.01)
        stats = prefill.statistics()
        # At most the chunk in flight when the client left: never the rest of the 20k prompt.
        assert stats.chunks - dropped_at <= 1
        assert stats.prefilling == 0 and stats.active_kv_bytes == 0
        assert lane.admission.statistics().in_flight_rows == 0
        before_short = stats.chunks
        done = await engine.complete(SHORT, max_tokens=2)
        assert done.usage.completion_tokens == 2
        assert prefill.statistics().chunks - before_short <= 2
        # The dropped prompt's prefix stays in the prompt cache for a retry.
        assert prefill.statistics().partial_puts == 1
