"""The prefill actor's cohorts: short prompts waiting together prefill in one lease job, and a
cancelled actor ends every request it had taken (none is left waiting)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import pytest
import trio
import trio.testing

from mlx_trio.actors.chunk_sizer import ChunkSizer, CohortCost
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
    """Rows decoding (or not), none of them in flight for prefill's sake; `rows` of them (default: a full batch
    of 8, so a burst of at most 8 never outnumbers them)."""

    def __init__(self, decoding: bool, rows: int | None = None) -> None:
        self.decoding = decoding
        self.num_rows = (rows if rows is not None else 8) if decoding else 0

    def in_flight(self) -> list[Generate]:
        return []


def _lane(lease: GpuLease, model: LoadedModel, *, decoding: bool = False, decoding_rows: int | None = None,
          **config: object) -> Lane:
    lane = Lane(EngineConfig(batch=8, **config), Faults())  # type: ignore[arg-type]
    lane.lease, lane.admission = lease, RecordingAdmission()  # type: ignore[assignment]
    lane.decode_step = _DecodeStep(decoding, decoding_rows)  # type: ignore[assignment]
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
                       in_sequence: bool = True, decoding_rows: int | None = None,
                       ) -> tuple[PrefillActor, trio.MemoryReceiveChannel[JoinRow]]:
    """A prefill actor as under prefill-only cuDNN, rows decoding, a 50 ms target, its sizer fitted to a fixed
    `forward_s` a forward; `in_sequence`: cohorts prefill row after row, as for a model whose attention is not
    routed (engine/attention/routed_attention.py)."""
    from mlx_trio.actors import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "prefill_only_cudnn", lambda: True)
    if in_sequence:
        from mlx_trio.engine.attention import routed_attention

        monkeypatch.setattr(routed_attention, "covers", lambda model: False)
    model: LoadedModel = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
    join_send, join_recv = trio.open_memory_channel[JoinRow](8)
    actor = PrefillActor(_lane(lease, model, decoding=True, decoding_rows=decoding_rows, prefill_step_size=64,
                               prefill_chunk_ms=50), lease, join=join_send)
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


class _FixedCohortCost(CohortCost):
    """A shared cohort fit fixed by the test: the jobs the test runs are not fitted (this CPU's times would move it)."""

    def __init__(self, *jobs: tuple[int, float]) -> None:
        super().__init__()
        for padded, seconds in jobs:
            super().record(padded, seconds)

    def record(self, padded: int, seconds: float) -> bool:
        return False


def _alone(model: object, prompt: tuple[int, ...]) -> tuple[int, int]:
    """The prompt prefilled alone (lease thread): its token 0 and the greedy token after it."""
    from mlx_trio.engine.batch.solo_row import SoloRow

    row = SoloRow(model, "alone", prompt, SamplingParams(max_tokens=8))
    while row.prefill_remaining:
        row.prefill_chunk()
    token0 = row.first_token()
    return token0, _next_token(model, row)


def _next_token(model: object, row: object) -> int:
    """The greedy token after the row's token 0, on its own caches (lease thread)."""
    import mlx.core as mx

    return int(mx.argmax(model(mx.array([[row.token0]]), cache=row.caches)[0, -1]).item())  # type: ignore[operator,attr-defined]


async def _shared_burst(lease: GpuLease, monkeypatch: pytest.MonkeyPatch, cohort_cost: CohortCost | None,
                        n: int = 8, decoding_rows: int | None = None) -> tuple[PrefillActor, list[int]]:
    """`n` short prompts at once under prefill-only cuDNN, sharing their forwards, rows decoding, a 50 ms target
    and a chunk sizer fitted to 1 ms a token (lone prompts' fixed cost read as a cost per token): the actor and
    the cohorts' sizes in rows, in order. Each row's token 0 and next token are checked against its prompt
    prefilled alone."""
    actor, join_recv = await _cudnn_actor(lease, monkeypatch, forward_s=0.010, in_sequence=False,
                                          decoding_rows=decoding_rows)
    actor.sizer = ChunkSizer(0.05, 64)
    actor.sizer.record(32, 0, 0.032)
    actor.sizer.record(64, 0, 0.064)
    if cohort_cost is not None:
        actor.cohort_cost = cohort_cost
    sizes: list[int] = []
    prefill_cohort = actor._prefill_cohort

    async def counted(cohort: list) -> None:  # type: ignore[type-arg]
        sizes.append(len(cohort))
        await prefill_cohort(cohort)

    actor._prefill_cohort = counted  # type: ignore[method-assign]
    joins, jobs = await _prefill_all(actor, lease, join_recv, n)
    assert actor._shares_forwards(_request(0)[0])
    assert [join.request.request_id for join in joins] == [f"r{i}" for i in range(n)]
    assert (jobs, actor.statistics().cohort_rows) == (len(sizes), n)
    model = actor._model.model
    for i, join in enumerate(joins):
        together = (join.token0, await lease.run(_next_token, model, join.row))
        assert together == await lease.run(_alone, model, _request(i)[0].prompt_ids)
        lease.free_nowait(join.row.close)  # type: ignore[attr-defined]
    return actor, sizes


async def test_under_prefill_only_cudnn_a_shared_cohort_is_not_sized_by_the_chunk_sizer(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any shared cohort job was measured, a cohort sharing its forwards is bounded only by its padded tokens
    (two forwards' worth): the chunk sizer's 1 ms a token would predict 88 ms for 8 x 11 padded tokens against the
    50 ms target, but all 8 go in one job; that job is the cohort fit's first sample (its padded tokens as run), and
    the chunk sizer's samples are untouched."""
    actor, sizes = await _shared_burst(lease, monkeypatch, None)
    assert actor.sizer.predict(88, 0) == pytest.approx(0.088)
    assert sizes == [8]
    assert [(padded, seconds > 0) for _, padded, _, seconds in actor.cohort_cost._samples] == [(88.0, True)]
    assert actor.cohort_cost.predict(88) is None  # one padded size: no fit yet
    assert len(actor.sizer._samples) == 2


async def test_under_prefill_only_cudnn_a_burst_goes_in_few_large_cohorts_when_shared_jobs_are_cheap(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared jobs measured at ~10 ms plus 30 us a padded token (22 tokens: 10 ms, 88: 12 ms): the 8 prompts go in
    one job, though the chunk sizer's fit says 88 ms for it."""
    cost = _FixedCohortCost((22, 0.010), (88, 0.012))
    _, sizes = await _shared_burst(lease, monkeypatch, cost)
    assert cost.predict(88) == pytest.approx(0.012)
    assert sizes == [8]


async def test_under_prefill_only_cudnn_a_burst_goes_in_smaller_cohorts_when_shared_jobs_are_dear(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared jobs measured at 1.5 ms a padded token and nothing fixed: 3 rows of 11 tokens (49.5 ms) fit the 50 ms
    target, 4 (66 ms) do not, so 8 prompts take jobs of 3, 3 and 2."""
    cost = _FixedCohortCost((22, 0.033), (44, 0.066))
    _, sizes = await _shared_burst(lease, monkeypatch, cost)
    assert (cost.predict(33), cost.predict(44)) == (pytest.approx(0.0495), pytest.approx(0.066))
    assert sizes == [3, 3, 2]


async def test_a_wave_that_outnumbers_the_decoding_rows_goes_in_one_cohort(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dear shared jobs of the test above (3 rows fit the 50 ms target), but 8 prompts wait behind 1 decoding
    row (a closed loop's next wave): the budget is 8 targets, and the 8 take one job (132 ms predicted)."""
    cost = _FixedCohortCost((22, 0.033), (44, 0.066))
    _, sizes = await _shared_burst(lease, monkeypatch, cost, decoding_rows=1)
    assert sizes == [8]


async def test_a_shared_cohort_never_holds_more_than_two_forwards_of_padded_tokens(
        lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """The static bound holds with or without a fit; one row always fits (it prefills alone, bounded as a chunk)."""
    from mlx_trio.actors.prefill import COHORT_JOB_CHUNKS
    from mlx_trio.engine.batch.cohort_prefill import COHORT_CUDNN_MAX_TOKENS

    actor, _ = await _cudnn_actor(lease, monkeypatch, forward_s=0.010, in_sequence=False)
    bound = COHORT_JOB_CHUNKS * COHORT_CUDNN_MAX_TOKENS
    assert [actor._shared_cohort_fits(8, padded) for padded in (bound, bound + 1)] == [True, False]
    actor.cohort_cost = _FixedCohortCost((100, 0.001), (200, 0.001))  # a fixed 1 ms whatever the size
    assert [actor._shared_cohort_fits(8, padded) for padded in (bound, bound + 1)] == [True, False]
    actor.cohort_cost = _FixedCohortCost((10, 0.060), (20, 0.060))  # a fixed 60 ms: over the 50 ms target
    assert [actor._shared_cohort_fits(rows, 40) for rows in (1, 2)] == [True, False]


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


@pytest.mark.parametrize("announced", [True, False])
async def test_a_wave_still_being_prepared_goes_in_one_cohort_job(lease: GpuLease, announced: bool) -> None:
    """r0 arrives first; r1-r3 are prepared and reach the actor 30 ms later. Announced as on their way
    (`Lane.arrivals`), the actor waits for them: one cohort job of four. Unannounced, r0 starts alone: two jobs."""
    model: LoadedModel = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
    join_send, join_recv = trio.open_memory_channel[JoinRow](8)
    lane = _lane(lease, model)
    actor = PrefillActor(lane, lease, join=join_send)
    requests = [_request(i)[0] for i in range(4)]
    if announced:
        for cmd in requests[1:]:
            lane.arrivals.prepared(cmd.request_id)
    jobs_before = lease.statistics().jobs_run
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        actor.inbox_send.send_nowait(requests[0])
        await trio.sleep(0.03)
        for cmd in requests[1:]:
            lane.arrivals.reached(cmd.request_id)  # as admission does when it takes one
            actor.inbox_send.send_nowait(cmd)
        with trio.fail_after(30):
            joins = [await join_recv.receive() for _ in range(4)]
        nursery.cancel_scope.cancel()
    assert sorted(join.request.request_id for join in joins) == ["r0", "r1", "r2", "r3"]
    assert lease.statistics().jobs_run - jobs_before == (1 if announced else 2)
    assert lane.arrivals.expected() == 0
    for join in joins:
        lease.free_nowait(join.row.close)  # type: ignore[attr-defined]


async def test_a_gather_for_requests_that_never_come_ends_after_its_bound(lease: GpuLease,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Announced requests that never reach the actor (their client left after the prepare) hold a cohort back
    for `GATHER_MAX_S` at most."""
    from mlx_trio.actors import prefill

    monkeypatch.setattr(prefill, "GATHER_MAX_S", 0.05)
    model: LoadedModel = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
    join_send, join_recv = trio.open_memory_channel[JoinRow](8)
    lane = _lane(lease, model)
    actor = PrefillActor(lane, lease, join=join_send)
    lane.arrivals.prepared("gone")
    cmd = _request(0)[0]
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        start = trio.current_time()
        actor.inbox_send.send_nowait(cmd)
        with trio.fail_after(30):
            join = await join_recv.receive()
        waited = trio.current_time() - start
        nursery.cancel_scope.cancel()
    assert join.request.request_id == "r0"
    assert 0.05 <= waited
    assert lane.arrivals.expected() == 1  # still counted until it expires (actors/arrivals.py)
    lease.free_nowait(join.row.close)  # type: ignore[attr-defined]
