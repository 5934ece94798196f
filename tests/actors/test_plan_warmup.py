"""cuDNN's prefill plans built ahead by the prefill actor (issue #19): before the first request, then in idle time.

The CPU has no cuDNN (and the lease thread never picks prefill-only cuDNN
there), so `plan_list` is replaced by one that lists the grid's shapes as
on CUDA (and the backend reads as chosen); the warm-up's chunks then run through the tiny model for real.
Checked: the shapes within `--cudnn-warm-tokens` are planned before the first
request is taken, the chunk sizer counts them as seen, the rest are planned
while idle with a request arriving meanwhile waiting for at most one plan,
and tokens are unchanged. Counted in lease jobs, never in seconds.
"""

from __future__ import annotations

import time

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.actors import plan_warmup
from mlx_trio.engine.batch.prefill_plans import PlanWarmer, grid_shapes
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

GRID = 256
PROMPT = [3 + (7 * i) % 500 for i in range(40)]
WAIT_S = 600.0  # only reached when a test fails


def _as_on_cuda(model, grid, step_size, max_keys):
    return PlanWarmer(model, GRID), grid_shapes(GRID, step_size, max_keys)


@pytest.fixture
def plans_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_warmup, "prefill_only_cudnn", lambda: True)
    monkeypatch.setattr(plan_warmup, "plan_list", _as_on_cuda)


async def _tokens(engine) -> list[int]:
    return (await engine.complete(PROMPT, max_tokens=6)).token_ids


async def test_no_plans_are_built_where_prefill_only_cudnn_is_off() -> None:
    async with open_engine(str(tiny_model(LLAMA))) as engine:
        await _tokens(engine)
        assert engine.actors.lane.prefill.statistics().cudnn_plans == 0


async def test_plans_are_built_before_the_first_request_then_while_idle(plans_as_on_cuda) -> None:
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=0) as plain:
        expected = await _tokens(plain)
    ahead = grid_shapes(GRID, 2048, 256)
    everything = grid_shapes(GRID, 2048, plan_warmup.IDLE_FACTOR * 256)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=256) as engine:
        prefill = engine.actors.lane.prefill
        lease = engine.actors.lane.lease
        lease.job_log = log = []
        planned_at_first_event = None
        async for event in engine.generate(PROMPT, max_tokens=6):
            if planned_at_first_event is None:
                planned_at_first_event = prefill.statistics().cudnn_plans
        # The first request was taken once every shape within the bound was planned (`warm_ahead`).
        assert planned_at_first_event is not None and planned_at_first_event >= len(ahead)
        assert all((s.tokens, s.keys) in prefill.sizer._seen for s in ahead)
        # A request that arrives during idle-time planning waits for one plan at most.
        sent = time.perf_counter()
        assert await _tokens(engine) == expected
        after = [name for name, start, _ in log if start >= sent]
        first_own = next(i for i, name in enumerate(after) if name != "PlanWarmer.warm")
        assert first_own <= 1
        with trio.fail_after(WAIT_S):
            while prefill.statistics().cudnn_plans < len(everything):
                await trio.sleep(0.02)
        assert prefill.statistics().cudnn_plans == len(everything)
        assert all((s.tokens, s.keys) in prefill.sizer._seen for s in everything)
        assert await _tokens(engine) == expected


async def test_idle_time_plans_wait_for_quiet_so_a_next_turn_never_waits_for_one(plans_as_on_cuda,
                                                                                 monkeypatch) -> None:
    """Turns sent back to back (an agent's loop) get no plan job between them, however many shapes are left to
    plan; once the engine has been quiet for PLAN_QUIET_S (here 3 s, so a slow box still sends the turns within
    it), the plans are built."""
    from mlx_trio.actors import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "PLAN_QUIET_S", 3.0)

    everything = grid_shapes(GRID, 2048, plan_warmup.IDLE_FACTOR * 256)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=256) as engine:
        prefill = engine.actors.lane.prefill
        await _tokens(engine)  # after the start's plans (`warm_ahead`)
        engine.actors.lane.lease.job_log = log = []
        planned = prefill.statistics().cudnn_plans
        assert planned < len(everything)  # shapes are left for idle time
        started = time.perf_counter()
        for _ in range(3):
            await _tokens(engine)
        assert time.perf_counter() - started < prefill_module.PLAN_QUIET_S  # the turns came back to back
        assert [name for name, _, _ in log if name == "PlanWarmer.warm"] == []
        assert prefill.statistics().cudnn_plans == planned
        with trio.fail_after(WAIT_S):
            while prefill.statistics().cudnn_plans < len(everything):
                await trio.sleep(0.02)


async def test_a_zero_bound_builds_no_plans(plans_as_on_cuda) -> None:
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=0) as engine:
        await _tokens(engine)
        await trio.sleep(0.1)
        assert engine.actors.lane.prefill.statistics().cudnn_plans == 0


async def test_health_says_warming_up_while_the_start_up_plans_are_built(plans_as_on_cuda, monkeypatch) -> None:
    """Requests wait while the plans of the start are built, so /health is not ok then, and says why."""
    seen: list[tuple[bool, str]] = []
    real = plan_warmup.PlanWarmup._plan

    async def observed(self, shape):
        seen.append(engine.actors.health())
        await real(self, shape)

    monkeypatch.setattr(plan_warmup.PlanWarmup, "_plan", observed)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=256) as engine:
        await _tokens(engine)
        ahead = grid_shapes(GRID, 2048, 256)
        warming = seen[:len(ahead)]
        assert warming and all(not ok and reason.startswith("warming up: building cuDNN prefill plans") for ok, reason in warming)
        assert f"0/{len(ahead)} chunk shapes" in warming[0][1]
        assert engine.actors.health() == (True, "ok")


async def test_a_warm_up_that_cannot_start_leaves_the_engine_serving(plans_as_on_cuda, monkeypatch) -> None:
    def broken(*_args):
        raise RuntimeError("no plans here")

    monkeypatch.setattr(plan_warmup, "plan_list", broken)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=0) as plain:
        expected = await _tokens(plain)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=256) as engine:
        assert await _tokens(engine) == expected
        assert engine.actors.lane.prefill.statistics().cudnn_plans == 0
        assert engine.actors.health() == (True, "ok")
