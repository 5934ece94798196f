"""A busy cycle's prefill budget (issue #46 point 2): several chunks in one lease job, up to the target.

The packing rule (`plan_chunks`, `budget_target_s`) is tested as a function; on the tiny model, a prompt
prefilled while a row decodes gets the same tokens through multi-chunk jobs as through one-chunk jobs, and
a prompt dropped while its multi-chunk jobs run ends with the pools idle (the autouse leak fixture).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.actors import prefill as prefill_module
from mlx_trio.actors.prefill import budget_target_s, plan_chunks
from mlx_trio.events import PromptProgress, TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

STEP = 64
BUDGET = 16 << 20  # --kv-layout paged sizes its block pool by the KV budget: small on this box
LONG = [3 + (31 * i) % 500 for i in range(1_500)]
DECODER = [3 + (7 * i) % 500 for i in range(40)]


def _flat(seconds: float) -> Any:
    return lambda tokens, context: seconds


def test_chunks_are_packed_until_the_predicted_time_reaches_the_target() -> None:
    assert plan_chunks(lambda c: 512, _flat(0.025), 0.1, 0, 10_000) == (512,) * 4
    # A chunk's cost grows with the context: fewer fit.
    assert plan_chunks(lambda c: 512, lambda n, c: 0.02 + c * 1e-5, 0.1, 0, 10_000) == (512,) * 3


def test_the_first_chunk_always_runs_and_an_unknown_cost_stops_the_packing() -> None:
    assert plan_chunks(lambda c: 512, _flat(0.5), 0.1, 0, 10_000) == (512,)
    assert plan_chunks(lambda c: 512, _flat(None), 0.1, 0, 10_000) == (512,)  # type: ignore[arg-type]


def test_the_budget_ends_with_the_prompt_and_at_a_snapshot_point() -> None:
    assert plan_chunks(lambda c: 512, _flat(0.01), 0.1, 100, 1_100) == (512, 512, 76)
    assert plan_chunks(lambda c: 512, _flat(0.01), 0.1, 0, 10_000, stop_at=700) == (512, 188)
    assert plan_chunks(lambda c: 512, _flat(0.01), 0.1, 700, 10_000, stop_at=700)[0] == 512  # already past it


def test_the_target_scales_with_the_decode_jobs_steps() -> None:
    assert [budget_target_s(0.1, rows) for rows in (0, 1, 7, 8, 47, 48, 64)] == pytest.approx(
        [0.1, 0.1, 0.1, 0.2, 0.2, 0.4, 0.4])


@contextlib.asynccontextmanager
async def _decoding(engine: Any) -> AsyncIterator[None]:
    """A row decodes in the background from its first token until the block ends (the engine is busy)."""
    async with trio.open_nursery() as nursery:
        decoding = trio.Event()

        async def decoder() -> None:
            async for event in engine.generate(DECODER, max_tokens=400):
                if isinstance(event, TextDelta):
                    decoding.set()

        nursery.start_soon(decoder)
        await decoding.wait()
        yield
        nursery.cancel_scope.cancel()


async def _long_while_decoding(engine: Any) -> tuple[list[int], int]:
    """The long prompt's greedy tokens, prefilled while another row decodes; and its prefill jobs (progress events)."""
    tokens: list[int] = []
    jobs = 0
    async with _decoding(engine):
        async for event in engine.generate(LONG, max_tokens=8):
            if isinstance(event, PromptProgress) and event.processed:
                jobs += 1
            elif isinstance(event, TextDelta):
                tokens.extend(event.token_ids)
    return tokens, jobs


@pytest.mark.parametrize("paged", [False, True], ids=["padded", "paged"])
async def test_multi_chunk_jobs_give_the_tokens_of_one_chunk_jobs(paged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prefill_step_size=STEP, kv_layout="paged" if paged else "padded",
                           kv_budget_bytes=BUDGET if paged else None) as engine:
        chunks_before = engine.actors.lane.prefill.statistics().chunks
        packed, jobs = await _long_while_decoding(engine)
        chunks = engine.actors.lane.prefill.statistics().chunks - chunks_before
    assert chunks > jobs  # several chunks ran in one job
    plan = prefill_module.plan_chunks
    monkeypatch.setattr(prefill_module, "plan_chunks", lambda *a, **k: plan(*a, **k)[:1])
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prefill_step_size=STEP, kv_layout="paged" if paged else "padded",
                           kv_budget_bytes=BUDGET if paged else None) as engine:
        single, _ = await _long_while_decoding(engine)
    assert len(packed) == 8 and packed == single


async def test_a_prompt_dropped_during_multi_chunk_jobs_ends_and_frees_its_row() -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prefill_step_size=STEP) as engine:
        lane = engine.actors.lane
        prefill = lane.prefill
        async with _decoding(engine):
            async with contextlib.aclosing(engine.generate(LONG, max_tokens=8)) as events:
                async for event in events:
                    if isinstance(event, PromptProgress) and event.processed >= 2 * STEP:
                        break  # the client gives up mid-prefill
            with trio.fail_after(60):
                while prefill.statistics().cancelled < 1:
                    await trio.sleep(0.01)
        stats = prefill.statistics()
        assert stats.prefilling == 0 and stats.active_kv_bytes == 0
        done = await engine.complete(DECODER, max_tokens=2)
        assert done.usage.completion_tokens == 2
