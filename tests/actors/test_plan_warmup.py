"""cuDNN's prefill plans built ahead by the prefill actor (issue #19): before the first request, then in idle time.

The CPU has no cuDNN (and the lease thread never picks prefill-only cuDNN
there), so `plan_list` is replaced by one that lists the grid's shapes as
on CUDA (and the backend reads as chosen); the warm-up's chunks then run through the tiny model for real.
Checked: no shape is planned before the first request (/health is ok at once),
the shapes within `--cudnn-warm-tokens` are planned
while idle, the chunk sizer counts them as seen, with a request arriving meanwhile waiting for at most one plan,
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


async def test_plans_are_built_in_idle_time_only_never_before_the_first_request(plans_as_on_cuda) -> None:
    """Issue #46: /health is ok and the first request is answered while idle time still has shapes to plan."""
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=0) as plain:
        expected = await _tokens(plain)
    everything = grid_shapes(GRID, 2048, 1024)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=1024) as engine:
        prefill = engine.actors.lane.prefill
        assert engine.actors.health() == (True, "ok")
        assert prefill.statistics().cudnn_plans < len(everything)  # ready before the plans
        lease = engine.actors.lane.lease
        lease.job_log = log = []
        sent = time.perf_counter()
        assert await _tokens(engine) == expected
        after = [name for name, start, _ in log if start >= sent]
        first_own = next(i for i, name in enumerate(after) if name != "PlanWarmer.warm")
        assert first_own <= 1  # a request waits for one plan at most
        with trio.fail_after(WAIT_S):
            while prefill.statistics().cudnn_plans < len(everything):
                await trio.sleep(0.02)
        assert all((s.tokens, s.keys) in prefill.sizer._seen for s in everything)
        assert await _tokens(engine) == expected


async def test_idle_time_plans_wait_for_quiet_so_a_next_turn_never_waits_for_one(plans_as_on_cuda,
                                                                                 monkeypatch) -> None:
    """Turns sent back to back (an agent's loop) get no plan job between them, however many shapes are left to
    plan; once the engine has been quiet for PLAN_QUIET_S (here 3 s, so a slow box still sends the turns within
    it), the plans are built."""
    from mlx_trio.actors import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "PLAN_QUIET_S", 3.0)

    everything = grid_shapes(GRID, 2048, 1024)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=1024) as engine:
        prefill = engine.actors.lane.prefill
        await _tokens(engine)
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


async def test_a_warm_up_that_cannot_start_leaves_the_engine_serving(plans_as_on_cuda, monkeypatch) -> None:
    def broken(*_args):
        raise RuntimeError("no plans here")

    monkeypatch.setattr(plan_warmup, "plan_list", broken)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=0) as plain:
        expected = await _tokens(plain)
    async with open_engine(str(tiny_model(LLAMA)), cudnn_warm_tokens=1024) as engine:
        assert await _tokens(engine) == expected
        assert engine.actors.lane.prefill.statistics().cudnn_plans == 0
        assert engine.actors.health() == (True, "ok")
