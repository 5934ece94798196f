"""The prefill actor's cohorts: short prompts waiting together prefill in one lease job, and a
cancelled actor ends every request it had taken (none is left waiting)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import pytest
import trio
import trio.testing

from mlx_trio.actors.gpu_lease import GpuLease, open_gpu_lease
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.messages import DecodeEvent, Generate, JoinRow, TokensDecoded
from mlx_trio.actors.prefill import PrefillActor, cohort_weight
from mlx_trio.config import EngineConfig
from mlx_trio.engine.lease_thread import release_thread_streams, thread_default_stream
from mlx_trio.engine.model.load import LoadedModel, load_model
from mlx_trio.params import SamplingParams
from mlx_trio.supervision.faults import Faults
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.actors.lane_fakes import RecordingAdmission


class _DecodeStep:
    """Rows decoding (or not), none of them in flight for prefill's sake."""

    def __init__(self, decoding: bool) -> None:
        self.decoding = decoding

    def in_flight(self) -> list[Generate]:
        return []


def _lane(lease: GpuLease, model: LoadedModel, *, decoding: bool = False, **config: object) -> Lane:
    lane = Lane(EngineConfig(batch=8, **config), Faults())  # type: ignore[arg-type]
    lane.lease, lane.admission, lane.decode_step = lease, RecordingAdmission(), _DecodeStep(decoding)  # type: ignore[assignment]
    lane.settle_model(model)
    return lane


@pytest.fixture
async def lease() -> AsyncIterator[GpuLease]:
    async with open_gpu_lease(on_thread_start=thread_default_stream, on_thread_exit=release_thread_streams) as lease:
        yield lease


def _request(i: int) -> tuple[Generate, trio.MemoryReceiveChannel[DecodeEvent]]:
    send, recv = trio.open_memory_channel[DecodeEvent](64)
    prompt = tuple(3 + (7 * i + j) % 300 for j in range(12))
    return Generate(f"r{i}", prompt, SamplingParams(max_tokens=8), send), recv


async def _prefill_all(actor: PrefillActor, lease: GpuLease, join_recv: trio.MemoryReceiveChannel[JoinRow],
                       n: int) -> tuple[list[JoinRow], int]:
    """`n` requests sent before the actor starts, until all joined: their joins and the lease jobs they took."""
    for admitted, _ in [_request(i) for i in range(n)]:
        actor.inbox_send.send_nowait(admitted)
    jobs_before = lease.statistics().jobs_run
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        with trio.fail_after(30):
            joins = [await join_recv.receive() for _ in range(n)]
        nursery.cancel_scope.cancel()
    return joins, lease.statistics().jobs_run - jobs_before


async def test_a_cancelled_cohort_ends_every_request_it_took(lease: GpuLease) -> None:
    """The decoder takes no joins (a restart is under way): cancelling prefill must close every reply."""
    model: LoadedModel = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
    join_send, join_recv = trio.open_memory_channel[JoinRow](0)  # nobody receives: hand-on blocks
    jobs_before = lease.statistics().jobs_run
    lane = _lane(lease, model)
    actor = PrefillActor(lane, lease, join=join_send)
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
    assert sorted(lane.admission.released) == ["r0", "r1", "r2", "r3"]  # type: ignore[union-attr]
    for _, replies in requests:
        events = [event async for event in replies]  # ends: the reply channel was closed
        assert any(isinstance(e, TokensDecoded) for e in events[:3]) or not events
    join_recv.close()


async def test_while_rows_decode_short_fresh_prompts_still_fill_a_whole_chunk_per_cohort(lease: GpuLease) -> None:
    """8 prompts of 12 tokens, prefill_step_size 64, rows decoding: 2 cohort jobs (5 + 3), not 8 of one each."""
    model: LoadedModel = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
    join_send, join_recv = trio.open_memory_channel[JoinRow](8)

    actor = PrefillActor(_lane(lease, model, decoding=True, prefill_step_size=64), lease, join=join_send)
    joins, jobs = await _prefill_all(actor, lease, join_recv, 8)
    assert [join.request.request_id for join in joins] == [f"r{i}" for i in range(8)]
    assert jobs == 2
    assert actor.statistics().cohort_rows == 8
    for join in joins:
        lease.free_nowait(join.row.close)  # type: ignore[attr-defined]


def test_a_cohort_row_weighs_its_tokens_times_the_chunks_its_context_spans() -> None:
    assert cohort_weight(127, 128, 2048) == 127
    assert cohort_weight(127, 8192 + 128, 2048) == pytest.approx(127 * 4.0625)
    assert int(2048 // cohort_weight(128, 8192 + 128, 2048)) == 3  # rows extending an 8k prefix: 3 per cohort


async def _cudnn_actor(lease: GpuLease, monkeypatch: pytest.MonkeyPatch, forward_s: float, *,
                       in_sequence: bool = True) -> tuple[PrefillActor, trio.MemoryReceiveChannel[JoinRow]]:
    """A prefill actor as under prefill-only cuDNN, rows decoding, a 50 ms target, its sizer fitted to a fixed
    `forward_s` a forward; `in_sequence`: cohorts prefill row after row (MLX_TRIO_COHORTS_IN_SEQUENCE)."""
    from mlx_trio.actors import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "prefill_only_cudnn", lambda: True)
    if in_sequence:
        monkeypatch.setenv("MLX_TRIO_COHORTS_IN_SEQUENCE", "1")
    model: LoadedModel = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
    join_send, join_recv = trio.open_memory_channel[JoinRow](8)
    actor = PrefillActor(_lane(lease, model, decoding=True, prefill_step_size=64, prefill_chunk_ms=50), lease,
                         join=join_send)
    actor.sizer.record(32, 0, forward_s)
    actor.sizer.record(64, 0, forward_s)
    return actor, join_recv


async def test_under_prefill_only_cudnn_a_cohort_takes_rows_until_their_predicted_prefills_fill_the_target(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that prefill one after another cost their own prefills: with each predicted at 20 ms (a fixed 10 ms
    per chunk and per token 0) and a 50 ms target, 8 short prompts prefill 2 to a job (4 jobs), where the
    tokens rule would put 5 and 3 together (the test above)."""
    actor, join_recv = await _cudnn_actor(lease, monkeypatch, forward_s=0.010)  # 10 ms a forward
    assert actor.sizer.predict_prefill(11, 0, 64) == pytest.approx(0.020)
    joins, jobs = await _prefill_all(actor, lease, join_recv, 8)
    assert [join.request.request_id for join in joins] == [f"r{i}" for i in range(8)]
    assert jobs == 4
    assert actor.statistics().cohort_rows == 8
    for join in joins:
        lease.free_nowait(join.row.close)  # type: ignore[attr-defined]


async def test_under_prefill_only_cudnn_a_cohort_that_shares_its_forwards_is_bounded_by_its_padded_tokens_time(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where short prompts share their forwards (a routed model, no switch), the rows' own 20 ms prefills do not
    bound the cohort: the predicted time of its padded tokens (rows x the longest) does. At 10 ms a forward
    whatever its size all 8 fit the 50 ms target in one job; at 0.625 ms a token (8 x ~11 padded tokens: 55 ms) they
    take two."""
    from mlx_trio.actors.chunk_sizer import ChunkSizer

    actor, join_recv = await _cudnn_actor(lease, monkeypatch, forward_s=0.010, in_sequence=False)
    joins, jobs = await _prefill_all(actor, lease, join_recv, 8)
    assert actor._shares_forwards(_request(0)[0])
    assert (jobs, actor.statistics().cohort_rows) == (1, 8)
    for join in joins:
        lease.free_nowait(join.row.close)  # type: ignore[attr-defined]

    actor, join_recv = await _cudnn_actor(lease, monkeypatch, forward_s=0.010, in_sequence=False)
    actor.sizer = ChunkSizer(0.05, 64)
    actor.sizer.record(32, 0, 0.020)
    actor.sizer.record(64, 0, 0.040)
    joins, jobs = await _prefill_all(actor, lease, join_recv, 8)
    assert [join.request.request_id for join in joins] == [f"r{i}" for i in range(8)]
    assert (jobs, actor.statistics().cohort_rows) == (2, 8)
    for join in joins:
        lease.free_nowait(join.row.close)  # type: ignore[attr-defined]


async def test_under_prefill_only_cudnn_a_row_predicted_over_the_target_alone_prefills_chunk_by_chunk(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 60 ms prediction against a 50 ms target: no cohort; each prompt takes its row's job and one chunk's,
    token 0's step in the last chunk's job (not a job of its own behind the next step link)."""
    actor, join_recv = await _cudnn_actor(lease, monkeypatch, forward_s=0.030)
    joins, jobs = await _prefill_all(actor, lease, join_recv, 2)
    assert actor.statistics().cohort_rows == 0
    assert actor.statistics().chunks == 2
    assert jobs == 4
    assert [join.token0 for join in joins] == [join.row.token0 for join in joins]
    for join in joins:
        lease.free_nowait(join.row.close)  # type: ignore[attr-defined]


def test_a_whole_prefill_is_predicted_as_its_chunks_and_token_0s_step() -> None:
    from mlx_trio.actors.chunk_sizer import ChunkSizer

    sizer = ChunkSizer(target_s=0.05, max_tokens=512)
    assert sizer.predict_prefill(100, 0, 64) is None
    for n, c in ((64, 0), (128, 256), (256, 1024), (32, 64)):
        sizer.record(n, c, 0.002 + 1e-5 * n + 1e-8 * n * (c + n / 2))
    expected = sum(sizer.predict(n, c) for n, c in ((64, 100), (64, 164), (22, 228))) + sizer.predict(1, 250)
    assert sizer.predict_prefill(150, 100, 64) == pytest.approx(expected)


async def test_under_prefill_only_cudnn_a_row_that_hit_the_grid_point_below_its_boundary_stores_no_snapshot(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill moves a snapshot boundary to the grid point below (engine/batch/chunked_prefill.py): a sibling
    agent whose hit ends there already has it, so it may join a cohort; a boundary above an uncached grid
    point still gets its snapshot, at that grid point."""
    from types import SimpleNamespace

    from mlx_trio.actors import prefill as prefill_module

    model: LoadedModel = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
    actor = PrefillActor(_lane(lease, model, decoding=True, prefill_grid=256), lease,
                         join=trio.open_memory_channel[JoinRow](1)[0])
    actor._model = model
    prompt = tuple(3 + j % 300 for j in range(900))
    cmd = Generate("r", prompt, SamplingParams(max_tokens=8), trio.open_memory_channel[DecodeEvent](1)[0],
                   snapshot_at=600)
    cached_at = {512}
    caching = SimpleNamespace(has=lambda ids: len(ids) in cached_at)
    hit = SimpleNamespace(usable=512)
    assert actor._snapshot_point(cmd, hit, caching) == 600  # MLX's kernels: the boundary itself
    monkeypatch.setattr(prefill_module, "prefill_only_cudnn", lambda: True)
    assert actor._snapshot_point(cmd, hit, caching) is None  # 600 -> 512, already there
    assert actor._snapshot_point(cmd, SimpleNamespace(usable=256), caching) is None  # 512 is cached
    cached_at.clear()
    assert actor._snapshot_point(cmd, SimpleNamespace(usable=256), caching) == 512
