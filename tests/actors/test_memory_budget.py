"""The KV budget follows the memory the device has (actors/memory_budget.py): an out-of-memory error shrinks it
once and the rows resume token-exact, a squeezed budget queues or refuses instead of running out, health says so."""

from __future__ import annotations

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.actors.memory_budget import FLOOR_FRACTION, RELAX_AFTER_S, SHRINK, MemoryBudget, out_of_memory
from mlx_trio.errors import Overloaded
from mlx_trio.events import TextDelta
from mlx_trio.supervision.faults import InjectedFault, InjectedOutOfMemory
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import PROMPTS, solo_tokens

MAX_TOKENS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_what_counts_as_out_of_memory() -> None:
    assert out_of_memory(RuntimeError("[malloc] Unable to allocate 4096 bytes."))
    assert out_of_memory(RuntimeError("[cuda] cudaMallocAsync failed: out of memory"))
    assert out_of_memory(RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory "
                                      "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"))
    assert out_of_memory(MemoryError()) and out_of_memory(InjectedOutOfMemory("[malloc] Unable to allocate 1 bytes."))
    assert not out_of_memory(InjectedFault("fault injected into decode-step"))
    assert not out_of_memory(ValueError("out of memory"))  # not an error MLX raises for memory


def test_an_out_of_memory_error_caps_the_budget_below_what_was_held_then_it_relaxes_back() -> None:
    clock = Clock()
    budget = MemoryBudget(1000, clock=clock)
    assert budget.current == 1000 and not budget.degraded and budget.report()["reason"] == ""
    budget.shrink(held=800)
    assert budget.current == int(800 * SHRINK) and budget.degraded
    assert "degraded: memory" in str(budget.report()["reason"]) and budget.report()["out_of_memory_errors"] == 1
    budget.shrink(held=10)  # a second error at the smaller budget shrinks again, to the floor at the least
    assert budget.current == int(1000 * FLOOR_FRACTION)
    assert not budget.relax()  # too soon
    risen = []
    for _ in range(20):
        clock.now += RELAX_AFTER_S
        budget.relax()
        risen.append(budget.current)
    assert risen == sorted(risen) and risen[-1] == 1000 and not budget.degraded


def test_the_budget_follows_what_other_processes_take_since_start() -> None:
    budget = MemoryBudget(1000)
    budget.follow(free=1100, ours=100)  # the first reading: 1200 left to us by the others
    assert budget.current == 1000 and not budget.degraded
    budget.follow(free=200, ours=1000)  # our own KV, activations and cached buffers grew: not a squeeze
    assert budget.current == 1000 and not budget.degraded
    budget.follow(free=300, ours=500)  # another process took 400
    assert budget.current == 600 and budget.degraded and budget.taken_by_others == 400
    assert "other processes took" in str(budget.report()["reason"])
    budget.follow(free=5000, ours=100)  # it left (and more is free than at start): never above the configured
    assert budget.current == 1000 and not budget.degraded
    budget.follow(free=None)  # a backend that reports nothing: the configured budget
    assert budget.current == 1000
    budget.follow(free=0, ours=0)
    assert budget.current == int(1000 * FLOOR_FRACTION)  # never below the floor


@pytest.fixture(scope="module")
def solo() -> list[tuple[int, ...]]:
    return solo_tokens(MAX_TOKENS)


async def _streams(engine, prompts, arm=None) -> list[tuple[int, ...]]:
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    started = trio.Semaphore(0)

    async def one(i: int) -> None:
        async for event in engine.generate(prompts[i], max_tokens=MAX_TOKENS):
            if isinstance(event, TextDelta):
                if not got[i]:
                    started.release()
                got[i].extend(event.token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
        if arm is not None:
            await started.acquire()
            arm()
    return [tuple(got[i]) for i in range(len(prompts))]


async def _memory(engine) -> MemoryBudget:
    """The lane's budget record, once admission knows its limits (after the model loaded)."""
    with trio.fail_after(30):
        while engine.actors.lane.memory is None or engine.actors.lane.admission is None:
            await trio.sleep(0.01)
    return engine.actors.lane.memory


async def _idle(engine) -> None:
    lane = engine.actors.lane
    with trio.fail_after(10):
        while lane.in_flight() or lane.admission is None or lane.admission.statistics().reserved_bytes:
            await trio.sleep(0.01)


@pytest.mark.parametrize("actor", ["decode-step", "prefill"])
async def test_out_of_memory_shrinks_the_budget_once_and_every_row_resumes_token_exact(solo, actor) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=8) as engine:
        memory = await _memory(engine)
        assert not memory.degraded
        arm = (lambda: engine.faults.arm(actor, "out-of-memory")) if actor == "decode-step" else None
        if arm is None:
            engine.faults.arm(actor, "out-of-memory")  # the first prefill runs out
        streams = await _streams(engine, PROMPTS, arm)
        assert streams == solo  # no stream saw the error: each resumed where it stood
        assert engine.faults.fired and memory.out_of_memory_errors == 1
        await _idle(engine)
        status = engine.status()
        assert status["memory"]["degraded"] and "degraded: memory" in status["memory"]["reason"]
        assert status["counters"]["kv_budget_bytes"] == memory.current < memory.configured
        assert engine.health()[0]  # degraded, not down: it serves
        memory.clock = lambda: float("inf")  # long after the error: the cap lifts step by step
        while memory.relax():
            pass
        assert not engine.status()["memory"]["degraded"]


async def test_a_budget_squeezed_at_run_time_queues_rows_and_refuses_what_cannot_fit_now(solo) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=8) as engine:
        lane = engine.actors.lane
        memory, admission = await _memory(engine), lane.admission
        layout, step = lane.model.kv_layout, engine.config.prefill_step_size
        lengths = [len(engine.prepare(p).prompt_ids) for p in PROMPTS[:4]]
        row = max(layout.row_bytes(n + MAX_TOKENS) for n in lengths)
        need = row + max(layout.prefill_peak_bytes(n, step) for n in lengths)  # one row and its prefill's peak
        memory.configured = need * 4  # a small device, so the floor (a sixteenth) is a quarter of a row
        memory.follow(free=need * 4, ours=0)  # the first reading
        memory.follow(free=need + row // 2, ours=0)  # another process took the rest: not all four fit at once
        assert memory.degraded and admission.budget_now == need + row // 2
        peak, most = 0, 0

        async def watch() -> None:
            nonlocal peak, most
            while True:
                stats = admission.statistics()
                peak, most = max(peak, stats.in_flight_rows), max(most, stats.reserved_bytes)
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            streams = await _streams(engine, PROMPTS[:4])
            nursery.cancel_scope.cancel()
        assert streams == solo[:4], (streams, solo[:4])
        assert most <= need + row // 2 and 1 <= peak < 4  # fewer rows at once than the four that came, never more
        await _idle(engine)
        memory.follow(free=need // 3, ours=0)  # less than the row needs, nothing running: 503 now, not a wait
        with pytest.raises(Overloaded) as refused:
            await engine.complete(PROMPTS[0], max_tokens=MAX_TOKENS)
        assert refused.value.retry_after_s and "short of memory" in str(refused.value)
        memory.follow(free=None)
        assert (await engine.complete(PROMPTS[0], max_tokens=MAX_TOKENS)).token_ids == solo[0]
        await _idle(engine)
