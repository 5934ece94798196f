"""The resume rule: a fault in any actor but a stream's own session never ends that stream.

A handful of streams (a long prompt prefilling chunk by chunk beside short ones) while more than
`MAX_RESUMES` faults in a row fire in one engine actor at a chosen moment: each while the long
prompt still prefills, so its attempts bring no token, one after another. Every stream still ends
with exactly the tokens of an unfaulted run (the chaos soak's in-band `engine_restarted` came from
counting such attempts against the stream). Only the stream's own session failing that often
ends it (tests/actors/test_session.py), as an `EngineRestarted`: a typed, retryable 503.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.api import MAX_RESUMES
from mlx_trio.errors import EngineRestarted
from mlx_trio.events import TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import PROMPTS

MAX_TOKENS = 12
LONG = " ".join(["the sea and the wind over the long shore"] * 12)
STREAMS = [LONG, PROMPTS[0], PROMPTS[2], PROMPTS[5]]
# A prefill budget of one chunk a job (a target far below any chunk's time): with a job of several chunks the
# long prompt may pass its last fault check while a fault is armed for it, and the fault never fires.
OPTIONS: dict[str, Any] = {"batch": 2, "prefill_step_size": 16, "prefill_chunk_ms": 0.001, "max_restarts": 1000,
                           "restart_period_s": 1.0}
FAULTS = MAX_RESUMES + 3


@pytest.fixture(scope="module")
def unfaulted() -> list[tuple[int, ...]]:
    async def main() -> list[tuple[int, ...]]:
        async with open_engine(str(tiny_model(LLAMA)), **OPTIONS) as engine:
            return [(await engine.complete(prompt, max_tokens=MAX_TOKENS)).token_ids for prompt in STREAMS]

    return trio.run(main)


def _long_prefilling(engine: Any) -> bool:
    """Whether the prefill actor holds the long prompt (prefilling it, or about to)."""
    prefill = engine.actors.lane.prefill
    return prefill is not None and any(len(cmd.prompt_ids) > 64 for cmd in prefill.in_flight())


def _queued(engine: Any) -> bool:
    """Whether a request waits in admission's queue (an admission fault fires as the next one is admitted)."""
    admission = engine.actors.lane.admission
    return admission is not None and bool(admission.queued())


async def _faults_in_a_row(engine: Any, actor: str) -> None:
    """Arm `FAULTS` faults at `actor`, one at a time, each once the previous fired and the long prompt is
    in prefill again (its attempt then brings no token), or for admission a request is queued; until cancelled."""
    moment = _queued if actor == "admission" else _long_prefilling
    for _ in range(FAULTS):
        while not moment(engine):
            await trio.sleep(0.001)
        engine.faults.arm(actor, "raise")
        while engine.faults.armed():
            await trio.sleep(0.001)


async def _streams(engine: Any, actor: str) -> list[tuple[int, ...]]:
    """Run `STREAMS` together while `_faults_in_a_row` fires at `actor`. Each stream's token ids."""
    got: list[list[int]] = [[] for _ in STREAMS]

    async def one(i: int) -> None:
        async for event in engine.generate(STREAMS[i], max_tokens=MAX_TOKENS):
            if isinstance(event, TextDelta):
                got[i].extend(event.token_ids)

    with trio.fail_after(60):
        async with trio.open_nursery() as faults:
            faults.start_soon(_faults_in_a_row, engine, actor)
            async with trio.open_nursery() as nursery:
                for i in range(len(STREAMS)):
                    nursery.start_soon(one, i)
            faults.cancel_scope.cancel()
    return [tuple(ids) for ids in got]


@pytest.mark.parametrize("actor", ["prefill", "gpu-lease", "decode-step", "admission", "cache-persistence"])
async def test_faults_in_a_row_in_other_actors_never_end_a_stream(unfaulted: list[tuple[int, ...]], actor: str,
                                                                  tmp_path: Path) -> None:
    async with open_engine(str(tiny_model(LLAMA)), **OPTIONS, prompt_cache_dir=str(tmp_path)) as engine:
        streams = await _streams(engine, actor)
        with trio.move_on_after(10):  # cache-persistence's next SSD write may come after the streams ended
            while not engine.faults.fired:
                await trio.sleep(0.01)
        fired = len(engine.faults.fired)
        # prefill and gpu-lease faults fire at the long prompt's next chunk; decode-step's at the next step of a
        # short row beside it, admission's when a queued one is admitted, cache-persistence's at the next SSD
        # write (none of these may come again before the streams end).
        assert fired == FAULTS if actor in ("prefill", "gpu-lease") else fired >= 1, engine.faults.fired
        with trio.fail_after(20):
            while not engine.health()[0] or engine.status()["counters"]["kv_bytes"]:
                await trio.sleep(0.01)
    assert streams == unfaulted


async def test_the_long_prompt_alone_survives_more_prefill_crashes_in_a_row_than_max_resumes(
        unfaulted: list[tuple[int, ...]]) -> None:
    """Every fault fires in the long prompt's prefill before its first token: attempts in a row with no token."""
    async with open_engine(str(tiny_model(LLAMA)), **OPTIONS) as engine:
        for _ in range(FAULTS):
            engine.faults.arm("prefill", "raise")
        with trio.fail_after(60):
            done = await engine.complete(LONG, max_tokens=MAX_TOKENS)
        assert len(engine.faults.fired) == FAULTS
    assert done.token_ids == unfaulted[0]


async def test_a_lane_that_keeps_failing_under_a_request_is_bounded_by_the_resume_timeout() -> None:
    """Faults in other actors never count, but a request that gets no token for `resume_timeout_s` while the
    lane keeps failing under it ends: `EngineRestarted`, a 503 with Retry-After on the HTTP side."""
    async with open_engine(str(tiny_model(LLAMA)), **{**OPTIONS, "resume_timeout_s": 0.3}) as engine:
        for _ in range(50):
            engine.faults.arm("prefill", "raise")
        with trio.fail_after(30), pytest.raises(EngineRestarted, match="without a new token"):
            await engine.complete(LONG, max_tokens=MAX_TOKENS)
        assert MAX_RESUMES < len(engine.faults.fired) < 50
