"""Tests for `mlx_trio.actors.gpu_lease`: ordering, errors, cancellation, thread ownership, close."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_trio.actors.gpu_lease import GpuLease, LeaseChain, LeaseStatistics, open_gpu_lease
from mlx_trio.engine.lease_thread import release_thread_streams, thread_default_stream
from mlx_trio.errors import LeaseClosed
from mlx_trio.supervision.faults import Faults, InjectedFault

# Generous bound for "the lease thread got there": only reached when a test fails.
WAIT_S = 5.0


@pytest.fixture
async def lease() -> AsyncIterator[GpuLease]:
    async with open_gpu_lease(on_thread_start=thread_default_stream, on_thread_exit=release_thread_streams) as lease:
        yield lease


class Gate:
    """A job that blocks the lease thread until released, so that later jobs stay queued."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def __call__(self, value: Any = None) -> Any:
        self.entered.set()
        assert self.release.wait(WAIT_S), "gate never released"
        self.finished.set()
        return value

    async def wait_entered(self) -> None:
        with trio.fail_after(WAIT_S):
            while not self.entered.is_set():
                await trio.sleep(0.001)


async def cancel_once_entered(gate: Gate, scope: trio.CancelScope) -> None:
    await gate.wait_entered()
    scope.cancel()


async def wait_for(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(WAIT_S):
        while not predicate():
            await trio.sleep(0.001)


# MLX helpers: the test file may import mlx (only mlx_trio/actors/ must not).


def mlx_ident_and_lazy_sum() -> tuple[int, Any]:
    import mlx.core as mx

    return threading.get_ident(), mx.arange(10) * 2  # lazy: recorded on this thread's stream


def mlx_eval_to_int(array: Any) -> tuple[int, int]:
    import mlx.core as mx

    return threading.get_ident(), int(mx.sum(array).item())


def mlx_evaluated_weights() -> Any:
    import mlx.core as mx

    weights = mx.ones((4, 4)) * 3
    mx.eval(weights)
    return weights


def mlx_shape_mismatch() -> None:
    import mlx.core as mx

    mx.ones((2, 3)) @ mx.ones((2, 3))


def failing_job() -> None:
    raise KeyError("from the job")


async def test_fifo_order_with_many_concurrent_callers(lease: GpuLease) -> None:
    """Jobs from many concurrent callers run exactly in submission order."""
    gate = Gate()
    submitted: list[int] = []
    executed: list[int] = []

    async def caller(i: int) -> None:
        # No checkpoint between recording and submitting: this is the submission order.
        submitted.append(i)
        assert await lease.run(executed.append, i) is None

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease.run, gate)
        await gate.wait_entered()
        for i in range(64):
            nursery.start_soon(caller, i)
        await trio.testing.wait_all_tasks_blocked()
        assert lease.statistics().queue_depth == 64
        gate.release.set()
    assert executed == submitted
    assert sorted(executed) == list(range(64))


async def test_return_value_and_exception_with_traceback(lease: GpuLease) -> None:
    """Results come back, errors re-raise the job's own exception with its frame, and the lease serves on."""
    assert await lease.run(pow, 2, 10) == 1024
    with pytest.raises(KeyError, match="from the job") as info:
        await lease.run(failing_job)
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_job" in frames
    with pytest.raises(ValueError):  # an MLX graph-time error, same path
        await lease.run(mlx_shape_mismatch)
    assert await lease.run(lambda: "still serving") == "still serving"
    stats = lease.statistics()
    assert (stats.jobs_run, stats.jobs_failed) == (4, 2)


async def test_cancel_while_queued_never_runs(lease: GpuLease) -> None:
    """A caller cancelled while its job is queued leaves at once and the job never runs."""
    gate = Gate()
    ran: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease.run, gate)
        await gate.wait_entered()
        with trio.move_on_after(0.05) as scope:
            await lease.run(ran.append, "queued")
        assert scope.cancelled_caught
        assert not gate.release.is_set()  # left while the thread was still busy
        assert lease.statistics().queue_depth == 0
        gate.release.set()
    await lease.run(ran.append, "after")
    assert ran == ["after"]
    assert lease.statistics().jobs_cancelled_queued == 1


async def test_cancel_while_running_waits_for_completion(lease: GpuLease) -> None:
    """By default a caller cancelled mid-job gets the result, then Cancelled at its next checkpoint."""
    gate = Gate()
    got: list[str] = []
    scope = trio.CancelScope()

    async def cancel_then_release() -> None:
        await gate.wait_entered()
        scope.cancel()
        await trio.sleep(0.05)
        assert not gate.finished.is_set()  # the caller is still waiting for the job
        gate.release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_then_release)
        with scope:
            got.append(await lease.run(gate, "result"))
            assert gate.finished.is_set()
            await trio.lowlevel.checkpoint()
            got.append("not reached")
    assert scope.cancelled_caught
    assert got == ["result"]
    assert lease.statistics().jobs_abandoned == 0


async def test_abandon_on_cancel_returns_at_once_and_job_completes(lease: GpuLease) -> None:
    """With abandon_on_cancel the caller leaves at once while the job still finishes on the thread."""
    gate = Gate()
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            nursery.start_soon(cancel_once_entered, gate, scope)
            await lease.run(gate, "dropped", abandon_on_cancel=True)
    assert scope.cancelled_caught
    assert gate.entered.is_set() and not gate.finished.is_set()
    gate.release.set()
    assert await lease.run(lambda: gate.finished.is_set())  # FIFO: queued behind the abandoned job
    stats = lease.statistics()
    assert (stats.jobs_abandoned, stats.jobs_run, stats.jobs_failed) == (1, 2, 0)


async def test_abandoned_job_failure_is_logged_and_counted(lease: GpuLease, caplog: pytest.LogCaptureFixture) -> None:
    """An abandoned job's exception is logged with its traceback and counted, not lost."""
    gate = Gate()

    def fail_after_gate() -> None:
        gate()
        raise RuntimeError("abandoned failure")

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            nursery.start_soon(cancel_once_entered, gate, scope)
            await lease.run(fail_after_gate, abandon_on_cancel=True)
    gate.release.set()
    with caplog.at_level(logging.ERROR, logger="mlx_trio.actors.gpu_lease"):
        await lease.run(lambda: None)
        await wait_for(lambda: "abandoned failure" in caplog.text)
    assert "fail_after_gate" in caplog.text
    assert lease.statistics().jobs_failed == 1


async def test_mlx_work_runs_on_the_lease_thread(lease: GpuLease) -> None:
    """Every job runs on the lease thread, so a lazy array from one job evaluates in a later one."""
    ident, lazy = await lease.run(mlx_ident_and_lazy_sum)
    ident2, total = await lease.run(mlx_eval_to_int, lazy)
    assert ident == ident2 == lease.statistics().thread_id != threading.get_ident()
    assert total == 90
    assert await lease.run(lease.on_lease_thread)
    assert not lease.on_lease_thread()


async def test_statistics_counters(lease: GpuLease) -> None:
    """Queue depth, the running job's start time, jobs_run and busy time are reported."""
    gate = Gate()
    before = lease.statistics()
    assert isinstance(before, LeaseStatistics)
    assert before.alive and not before.closed and before.running_since is None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease.run, gate)
        await gate.wait_entered()
        for _ in range(3):
            nursery.start_soon(lease.run, time.sleep, 0)
        await trio.testing.wait_all_tasks_blocked()
        busy = lease.statistics()
        assert busy.queue_depth == busy.mailbox_depth == 3
        assert busy.running_since is not None and busy.running_since <= time.monotonic()
        await trio.sleep(0.02)
        gate.release.set()
    after = lease.statistics()
    assert (after.queue_depth, after.jobs_run, after.running_since) == (0, 4, None)
    assert after.busy_s >= 0.02
    assert 0 < after.busy_fraction <= 1


async def test_close_fails_queued_and_new_callers_and_runs_thread_exit() -> None:
    """Closing fails queued callers at once, lets the running job finish, and runs on_thread_exit on the thread."""
    gate = Gate()
    exits: list[threading.Thread] = []
    results: dict[str, Any] = {}

    def on_exit() -> None:
        exits.append(threading.current_thread())
        release_thread_streams()

    async def call(key: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            results[key] = await lease.run(fn, *args)
        except LeaseClosed:
            results[key] = ("closed", gate.release.is_set())

    async with trio.open_nursery() as outer:
        async with open_gpu_lease(on_thread_exit=on_exit) as lease:
            await lease.run(mlx_ident_and_lazy_sum)  # leaves MLX work for the exit hook to release
            outer.start_soon(call, "running", gate, "finished")
            await gate.wait_entered()
            outer.start_soon(call, "queued1", pow, 2, 2)
            outer.start_soon(call, "queued2", pow, 3, 3)
            await trio.testing.wait_all_tasks_blocked()
            lease_thread_id = lease.statistics().thread_id

            async def release_later() -> None:
                await trio.sleep(0.05)
                gate.release.set()

            outer.start_soon(release_later)
        stats = lease.statistics()
    assert results == {"running": "finished", "queued1": ("closed", False), "queued2": ("closed", False)}
    assert not stats.alive and stats.closed and stats.queue_depth == 0
    assert [t.ident for t in exits] == [lease_thread_id]
    with pytest.raises(LeaseClosed):
        await lease.run(pow, 2, 2)
    with pytest.raises(LeaseClosed):
        lease.submit_nowait(pow, 2, 2)


async def test_restart_gets_new_thread_and_keeps_evaluated_arrays() -> None:
    """A new lease after a closed one runs on a new thread and can use arrays evaluated by the old one."""
    async with open_gpu_lease(on_thread_exit=release_thread_streams) as first:
        weights = await first.run(mlx_evaluated_weights)
        first_thread = await first.run(threading.current_thread)
    assert not first_thread.is_alive()
    async with open_gpu_lease(on_thread_exit=release_thread_streams) as second:
        second_thread = await second.run(threading.current_thread)
        _, total = await second.run(mlx_eval_to_int, weights)
    assert second_thread is not first_thread
    assert total == 48


async def test_submit_nowait_runs_in_order_and_logs_failures(lease: GpuLease, caplog: pytest.LogCaptureFixture) -> None:
    """Fire-and-forget jobs run in FIFO order with run() jobs; their failures are logged and counted."""
    order: list[int] = []
    with caplog.at_level(logging.ERROR, logger="mlx_trio.actors.gpu_lease"):
        lease.submit_nowait(order.append, 1)
        lease.submit_nowait(failing_job)
        lease.submit_nowait(order.append, 2)
        await lease.run(order.append, 3)
    assert order == [1, 2, 3]
    assert "failing_job" in caplog.text and "from the job" in caplog.text
    assert lease.statistics().jobs_failed == 1


async def test_chain_reruns_until_false_and_lets_jobs_queued_meanwhile_go_first(lease: GpuLease) -> None:
    """Each next run queues behind the jobs submitted while the last one ran (FIFO); False ends the chain."""
    order: list[str] = []
    gate = Gate()

    def link() -> bool:
        order.append("link")
        if len(order) == 1:
            gate()  # hold the first run until a job is queued behind it
        return order.count("link") < 3

    chain = lease.chain(link)
    await gate.wait_entered()
    lease.submit_nowait(order.append, "job")
    gate.release.set()
    with trio.fail_after(WAIT_S):
        await chain.wait()
    assert order == ["link", "job", "link", "link"]


async def test_chain_delivers_only_its_end_to_trio(lease: GpuLease, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs that go on wake nothing on the Trio thread: one delivery for the whole chain."""
    delivered: list[object] = []
    deliver = LeaseChain._set
    monkeypatch.setattr(LeaseChain, "_set", lambda self, result: delivered.append(result) or deliver(self, result))
    runs = iter(range(50))
    chain = lease.chain(lambda: next(runs) < 49)
    await chain.wait()
    assert len(delivered) == 1
    assert lease.statistics().jobs_run == 50


async def test_chain_stop_lets_the_running_link_finish_and_starts_no_other(lease: GpuLease) -> None:
    """stop() from Trio: the link running now completes, no further link runs, wait() returns."""
    runs: list[int] = []
    gate = Gate()

    def link() -> bool:
        runs.append(1)
        if len(runs) == 2:
            gate()
        return True

    chain = lease.chain(link)
    await gate.wait_entered()
    chain.stop()
    gate.release.set()
    with trio.fail_after(WAIT_S):
        await chain.wait()
    assert await lease.run(len, runs) == 2


async def test_chain_wait_reraises_what_a_link_raised_and_the_lease_goes_on(lease: GpuLease) -> None:
    runs = iter(range(10))

    def link() -> bool:
        if next(runs) == 3:
            failing_job()
        return True

    with pytest.raises(KeyError, match="from the job"):
        await lease.chain(link).wait()
    assert await lease.run(pow, 2, 3) == 8


async def test_chain_links_take_injected_faults() -> None:
    """A RAISE fault armed for the lease fails the next link, as it would any job."""
    faults = Faults()
    async with open_gpu_lease(faults=faults) as lease:
        runs: list[int] = []
        chain = lease.chain(lambda: runs.append(1) or True)
        await wait_for(lambda: len(runs) >= 3)
        faults.arm(lease.name, "raise")
        with pytest.raises(InjectedFault):
            await chain.wait()
    assert faults.fired


async def test_close_ends_a_running_chain_with_lease_closed() -> None:
    async with open_gpu_lease() as lease:
        chain = lease.chain(lambda: time.sleep(0.001) or True)
        await wait_for(lambda: lease.statistics().jobs_run >= 3)
    with pytest.raises(LeaseClosed):
        await chain.wait()
    with pytest.raises(LeaseClosed):
        lease.chain(lambda: True)


async def test_to_trio_soon_runs_on_the_trio_thread_before_the_job_result_arrives(lease: GpuLease) -> None:
    """A job's to_trio_soon calls run in order on the Trio thread, all before its caller resumes."""
    seen: list[tuple[str, int]] = []

    def job() -> str:
        for i in range(3):
            lease.to_trio_soon(lambda i=i: seen.append(("trio" if trio.lowlevel.in_trio_run() else "other", i)))
        return "done"

    assert await lease.run(job) == "done"
    assert seen == [("trio", 0), ("trio", 1), ("trio", 2)]


async def test_close_still_runs_queued_submit_nowait_jobs() -> None:
    """Cleanup jobs queued with submit_nowait run before the thread exits, even when closing."""
    gate = Gate()
    order: list[str] = []
    async with trio.open_nursery() as outer:
        async with open_gpu_lease(on_thread_exit=lambda: order.append("exit")) as lease:
            outer.start_soon(lease.run, gate)
            await gate.wait_entered()
            lease.submit_nowait(order.append, "cleanup")
            gate.release.set()
    assert order == ["cleanup", "exit"]


async def test_wedged_thread_close_times_out_and_fails_the_waiter(caplog: pytest.LogCaptureFixture) -> None:
    """A job that outlives close_timeout_s is reported as wedged and its caller gets LeaseClosed."""
    gate = Gate()
    failed_at: list[float] = []

    async def waiter(lease: GpuLease) -> None:
        with pytest.raises(LeaseClosed, match="wedged"):
            await lease.run(gate)
        failed_at.append(trio.current_time())

    try:
        with caplog.at_level(logging.ERROR, logger="mlx_trio.actors.gpu_lease"):
            async with trio.open_nursery() as outer:
                async with open_gpu_lease(close_timeout_s=0.1) as lease:
                    outer.start_soon(waiter, lease)
                    await gate.wait_entered()
                    closed_at = trio.current_time()
        assert failed_at and failed_at[0] - closed_at < 1.0
        assert "wedged" in caplog.text
        assert lease.statistics().alive  # left behind; the process must restart
    finally:
        gate.release.set()
    await wait_for(lambda: not lease.statistics().alive)


async def test_on_thread_start_failure_fails_serve_and_still_runs_exit() -> None:
    """If on_thread_start raises, serve raises that error and on_thread_exit still runs."""
    exits: list[str] = []

    def bad_start() -> None:
        raise OSError("no device")

    lease = GpuLease(on_thread_start=bad_start, on_thread_exit=lambda: exits.append("exit"))
    async with trio.open_nursery() as nursery:
        with pytest.raises(OSError, match="no device"):
            await nursery.start(lease.serve)
    assert exits == ["exit"]
    assert not lease.statistics().alive
    with pytest.raises(LeaseClosed):
        await lease.run(pow, 2, 2)


async def test_unserved_lease_refuses_jobs_and_cannot_serve_twice() -> None:
    """A lease that was never served refuses jobs; a closed lease cannot be served again."""
    lease = GpuLease()
    with pytest.raises(LeaseClosed):
        await lease.run(pow, 2, 2)
    assert lease.statistics().thread_id is None
    async with trio.open_nursery() as nursery:
        await nursery.start(lease.serve)
        nursery.cancel_scope.cancel()
    with pytest.raises(RuntimeError, match="already served"):
        await lease.serve()


@settings(max_examples=25, deadline=None)
@given(plan=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=12))
async def test_random_cancellations_keep_the_lease_consistent(plan: list[tuple[bool, bool]]) -> None:
    """For any mix of completed and queue-cancelled callers, exactly the survivors run, in order."""
    gate = Gate()
    executed: list[int] = []
    async with open_gpu_lease() as lease:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lease.run, gate)
            await gate.wait_entered()
            scopes = []
            for i, (cancel, abandon) in enumerate(plan):
                scope = trio.CancelScope()
                scopes.append(scope)

                async def caller(i: int = i, scope: trio.CancelScope = scope, abandon: bool = abandon) -> None:
                    with scope:
                        await lease.run(executed.append, i, abandon_on_cancel=abandon)

                nursery.start_soon(caller)
                await trio.testing.wait_all_tasks_blocked()
            for scope, (cancel, _) in zip(scopes, plan):
                if cancel:
                    scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            gate.release.set()
        stats = lease.statistics()
    survivors = [i for i, (cancel, _) in enumerate(plan) if not cancel]
    assert executed == survivors
    assert stats.jobs_cancelled_queued == len(plan) - len(survivors)
    assert (stats.jobs_run, stats.queue_depth, stats.jobs_abandoned) == (1 + len(survivors), 0, 0)
