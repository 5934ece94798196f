"""Large batches run several decode steps per lease job; every row still gets exactly its tokens alone (--batch 1)."""

from __future__ import annotations

import trio

from mlx_trio import open_engine
from mlx_trio.actors.decode_step import steps_per_job
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import PROMPTS


def test_steps_per_job_grows_with_the_batch() -> None:
    assert [steps_per_job(b) for b in (1, 7, 8, 16, 47, 48, 64)] == [1, 1, 2, 2, 2, 4, 4]


async def _alone_and_together(requests: list[tuple[str, int]], *, stagger_s: float = 0.0,
                              log: list[tuple[str, float, float]] | None = None
                              ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Each request's tokens alone (--batch 1), then all at once (--batch = their number, `stagger_s` apart).

    With `log`, the batched engine's lease jobs go there (`GpuLease.job_log`). Waits until no KV remains.
    """
    path = str(tiny_model(LLAMA))
    async with open_engine(path, batch=1) as alone:
        expected = [(await alone.complete(p, max_tokens=n)).token_ids for p, n in requests]
    got: dict[int, tuple[int, ...]] = {}
    async with open_engine(path, batch=len(requests)) as engine:
        engine.actors.lane.lease.job_log = log

        async def one(i: int) -> None:
            await trio.sleep(stagger_s * i)
            prompt, n = requests[i]
            got[i] = (await engine.complete(prompt, max_tokens=n)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)
        with trio.fail_after(10):
            while engine.status()["counters"]["kv_bytes"]:
                await trio.sleep(0.01)
        engine.actors.lane.lease.job_log = None
        assert engine.actors.lane.decode_step.statistics().active_rows == 0
    return [got[i] for i in range(len(requests))], expected


async def test_twenty_rows_with_staggered_lengths_equal_their_runs_alone() -> None:
    """Rows finish inside a multi-step job (max_tokens 1..20): tokens, counts and KV all come out exact."""
    got, expected = await _alone_and_together([(f"{PROMPTS[i % len(PROMPTS)]} {i}", 1 + i) for i in range(20)])
    assert got == expected


async def test_each_membership_change_is_one_lease_job_and_rows_stay_exact() -> None:
    """Staggered rows join and leave: every settle is one `_membership` job (no separate flush, leave or join)."""
    log: list[tuple[str, float, float]] = []
    got, expected = await _alone_and_together([(f"{PROMPTS[i % len(PROMPTS)]} {i}", 3 + 2 * i) for i in range(8)],
                                              stagger_s=0.01, log=log)
    names = {name for name, _, _ in log}
    assert "_membership" in names
    assert not names & {"DecodeBatch.flush_decoded", "DecodeBatch.leave", "DecodeBatch.join_many"}
    assert got == expected
