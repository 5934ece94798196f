"""--kv-layout paged: admission credits a cached prefix (docs/design.md §6.5): a request reserves the blocks its row
will allocate, not the shared prefix blocks it only references, which are pinned from admission until its row joins.

Siblings with a long shared prefix run together where the conservative count (every reader reserving the whole
prompt) queued them; their tokens are those each gets alone, and every pool (pins included) is idle after.
"""

from __future__ import annotations

import trio

from mlx_trio import open_engine
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

BLOCK = 16
PREFIX = [(7 * i + 3) % 200 + 10 for i in range(10 * BLOCK)]  # 10 full blocks
SIBLINGS = [PREFIX + [300 + i, 400 + i, 500 + i] for i in range(8)]
MAX_TOKENS = 96  # conservatively ceil((163 + 96) / 16) = 17 blocks a row; credited 7 own + the 10 shared once
# The largest prefill transient (163 tokens' chunk: 1,174,176 bytes) + 100 blocks of the tiny llama (8 KiB each).
BUDGET = 1_174_176 + 100 * 8192


async def _peak_in_flight(engine, prompts: list[list[int]]) -> tuple[int, list[tuple[int, ...]]]:
    """Run `prompts` at once; the most rows admission held in flight together, and each one's tokens."""
    admission = engine.actors.lane.admission
    peak = 0
    out: list[tuple[int, ...]] = [()] * len(prompts)

    async def one(i: int) -> None:
        out[i] = (await engine.complete(prompts[i], max_tokens=MAX_TOKENS, temperature=0)).token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
        done = trio.Event()

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, admission.statistics().in_flight_rows)
                await trio.sleep(0)

        nursery.start_soon(watch)
        while any(not tokens for tokens in out):
            await trio.sleep(0.005)
        done.set()
    return peak, out


async def test_siblings_sharing_a_cached_prefix_are_admitted_together_where_the_conservative_count_queued_them(
) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET) as engine:
        blocks = engine.status()["counters"]["kv_blocks"]
        block_bytes, total = blocks["block_bytes"], blocks["total"]
        # A budget where 8 conservative rows (8 x 17 blocks) cannot run together but credited ones (10 + 8 x 7) can.
        lane = engine.actors.lane
        transient = lane.model.kv_layout.prefill_peak_bytes(len(SIBLINGS[0]), lane.config.prefill_step_size)
        assert block_bytes == 8192 and transient + 8 * 17 * block_bytes > total * block_bytes
        assert transient + (10 + 8 * 7) * block_bytes <= total * block_bytes
        alone = [(await engine.complete(p, max_tokens=MAX_TOKENS, temperature=0)).token_ids for p in SIBLINGS[:1]]
        peak, tokens = await _peak_in_flight(engine, SIBLINGS)
        assert peak == len(SIBLINGS), f"only {peak} siblings were admitted together"
        assert tokens[0] == alone[0]
        for i, prompt in enumerate(SIBLINGS[1:], 1):
            assert (await engine.complete(prompt, max_tokens=MAX_TOKENS, temperature=0)).token_ids == tokens[i]
        with trio.fail_after(5):
            while engine.status()["counters"]["kv_blocks"]["used"] or engine.actors.lane.pins:
                await trio.sleep(0.01)
        assert engine.actors.lane.admission.statistics().reserved_bytes == 0


async def test_a_lease_crash_drops_the_pins_of_the_requests_it_ended_and_the_streams_resume_exact() -> None:
    """The pool outlives a crashed lease, so must not keep its pins' references: a pin whose unpin finds no lease
    waits in `Lane.stale_pins` and the restarted admission drops it before it pins anything."""
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET) as engine:
        await engine.complete(SIBLINGS[0], max_tokens=MAX_TOKENS, temperature=0)  # the prefix's blocks cached
        _, undisturbed = await _peak_in_flight(engine, SIBLINGS)
        engine.faults.arm("gpu-lease", "raise")
        _, resumed = await _peak_in_flight(engine, SIBLINGS)
        assert engine.faults.fired, "the fault never fired"
        assert resumed == undisturbed
        lane = engine.actors.lane
        with trio.fail_after(10):
            while engine.status()["counters"]["kv_blocks"]["used"] or lane.pins or lane.stale_pins:
                await trio.sleep(0.01)


class _InlineLease:
    """Runs each job at once on the caller's thread (the pool's bookkeeping is pure Python)."""

    async def run(self, fn, *args):
        return fn(*args)

    def submit_nowait(self, fn, *args) -> None:
        fn(*args)


async def test_a_pin_whose_unpin_finds_no_lease_is_dropped_by_the_next_admission_not_leaked() -> None:
    from types import SimpleNamespace

    from mlx_trio.actors.lane import Lane
    from mlx_trio.config import EngineConfig
    from mlx_trio.supervision.faults import Faults
    from tests.engine.kv.test_prefix_pin import _kv, _prefill

    kv = _kv(8)
    _prefill(kv, list(range(1, 10)))
    lane = Lane(EngineConfig(batch=2), Faults())
    lane.model = SimpleNamespace(paged_kv=kv)  # type: ignore[assignment]
    crashed, orphan = kv.pin_prefix(list(range(1, 10))), kv.pin_prefix(list(range(1, 10)))
    lane.unpin(crashed)  # no lease serving: parked, still referenced
    lane.pins["gone"] = orphan  # a request no actor holds any more
    assert lane.stale_pins == [crashed] and not kv.pool.idle
    assert any("prefix pins held: 2" in line for line in lane.not_idle())
    lane.lease = _InlineLease()  # type: ignore[assignment]
    await lane.drop_stale_pins()
    assert kv.pool.idle and not lane.pins and not lane.stale_pins
    lane.unpin(crashed)  # idempotent once dropped
    kv.pool.check()
