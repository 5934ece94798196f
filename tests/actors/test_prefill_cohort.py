"""The prefill actor's cohorts: short prompts waiting together prefill in one lease job, and a
cancelled actor ends every request it had taken (none is left waiting)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import pytest
import trio
import trio.testing

from mlx_trio.actors.gpu_lease import GpuLease, open_gpu_lease
from mlx_trio.actors.messages import Admitted, DecodeEvent, Generate, JoinRow, TokensDecoded
from mlx_trio.actors.prefill import PrefillActor
from mlx_trio.engine.lease_thread import release_thread_streams, thread_default_stream
from mlx_trio.engine.model import LoadedModel, load_model
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model


@pytest.fixture
async def lease() -> AsyncIterator[GpuLease]:
    async with open_gpu_lease(on_thread_start=thread_default_stream, on_thread_exit=release_thread_streams) as lease:
        yield lease


def _request(i: int) -> tuple[Admitted, trio.MemoryReceiveChannel[DecodeEvent]]:
    send, recv = trio.open_memory_channel[DecodeEvent](64)
    prompt = tuple(3 + (7 * i + j) % 300 for j in range(12))
    return Admitted(Generate(f"r{i}", prompt, SamplingParams(max_tokens=8), send), 0), recv


async def test_a_cancelled_cohort_ends_every_request_it_took(lease: GpuLease) -> None:
    """The decoder takes no joins (a restart is under way): cancelling prefill must close every reply."""
    model: LoadedModel = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
    join_send, join_recv = trio.open_memory_channel[JoinRow](0)  # nobody receives: hand-on blocks
    released: list[str] = []
    jobs_before = lease.statistics().jobs_run

    async def get_model() -> LoadedModel:
        return model

    actor = PrefillActor(lease, get_model, join=join_send, release=released.append, max_rows=8)
    requests = [_request(i) for i in range(4)]
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        for admitted, _ in requests:
            actor.inbox_send.send_nowait(admitted)
        with trio.fail_after(30):
            while not actor.in_flight() or lease.statistics().queue_depth or lease.statistics().running_since:
                await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()
        assert lease.statistics().jobs_run - jobs_before == 1  # the four prefilled in one job
        nursery.cancel_scope.cancel()
    assert sorted(released) == ["r0", "r1", "r2", "r3"]
    for _, replies in requests:
        events = [event async for event in replies]  # ends: the reply channel was closed
        assert any(isinstance(e, TokensDecoded) for e in events[:3]) or not events
    join_recv.close()
