"""The GPU lease: one dedicated OS thread that runs every MLX call of the process.

MLX binds streams and command encoders to the thread that created them (a lazy
array built in one thread cannot be evaluated in another), and a thread that
used MLX must release its streams before it exits. `trio.to_thread` moves work
between pooled threads, so it cannot be the lease. `GpuLease` owns one daemon
thread for its whole life and feeds it jobs in FIFO order; Trio callers park
with `trio.lowlevel.wait_task_rescheduled` and are woken through the run's
`trio.lowlevel.TrioToken`. See docs/gpu-lease.md for the contract and numbers.

This module never imports MLX: MLX thread set-up and tear-down are injected as
``on_thread_start`` / ``on_thread_exit`` (see `mlx_trio.engine.lease_thread`).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import outcome
import trio

from mlx_trio.errors import LeaseClosed

log = logging.getLogger(__name__)
T = TypeVar("T")


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    SKIPPED = "skipped"  # withdrawn by a cancelled caller or failed at close; never runs


class _Job:
    """One call waiting for or running on the lease thread."""

    __slots__ = ("fn", "args", "name", "task", "state", "detached")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], task: trio.lowlevel.Task | None) -> None:
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple[Any, ...] = args
        self.name: str = getattr(fn, "__qualname__", None) or repr(fn)  # for logs
        # None for submit_nowait jobs: nobody waits, failures are logged.
        self.task = task
        # Invariant: changed only under GpuLease._lock; QUEUED -> RUNNING -> DONE
        # by the lease thread, QUEUED -> SKIPPED by the Trio thread.
        self.state = _State.QUEUED
        # Set (Trio thread only) when the waiter left: the result must be dropped.
        self.detached = False


_STOP = object()  # queue sentinel: the lease thread runs on_thread_exit and ends


@attrs.frozen
class LeaseStatistics:
    """A snapshot of a `GpuLease`, for the status tree and the watchdog.

    Attributes:
      queue_depth: jobs waiting in the queue, not counting the running one.
      mailbox_depth: the same number, under the name the supervision tree reads.
      jobs_run: jobs whose function was called and returned or raised.
      jobs_failed: of those, the jobs whose function raised.
      jobs_cancelled_queued: jobs withdrawn by a cancelled caller before they ran.
      jobs_abandoned: running jobs whose caller left (``abandon_on_cancel``).
      busy_s: seconds spent running jobs, the current one included.
      busy_fraction: ``busy_s`` divided by the thread's uptime (0 before start).
      running_since: `time.monotonic` at which the current job started, or None
        when idle; a value far in the past means the thread is wedged.
      thread_id: `threading.get_ident` of the lease thread, None before start.
      alive: whether the lease thread is running.
      closed: whether the lease refuses new jobs.
    """

    queue_depth: int
    mailbox_depth: int
    jobs_run: int
    jobs_failed: int
    jobs_cancelled_queued: int
    jobs_abandoned: int
    busy_s: float
    busy_fraction: float
    running_since: float | None
    thread_id: int | None
    alive: bool
    closed: bool


class GpuLease:
    """Runs callables, one at a time and in submission order, on one dedicated thread.

    Every MLX call of the process (weight loading, graph building, eval,
    freeing) goes through `run` or `submit_nowait`, so it all happens on the
    same OS thread and therefore on the same MLX streams. The thread starts
    when `serve` starts and ends when `serve` is cancelled; a closed lease
    never reopens (make a new one; only *evaluated* arrays survive the switch).

    Args:
      name: the thread's name, also used in log messages.
      on_thread_start: called first in the lease thread; if it raises, `serve`
        raises that error instead of starting.
      on_thread_exit: called last in the lease thread, also after a failed
        start; for MLX pass `mlx_trio.engine.lease_thread.release_thread_streams`.
      close_timeout_s: how long closing waits for the running job to finish and
        the thread to exit before it declares the thread wedged.
    """

    def __init__(
        self,
        *,
        name: str = "gpu-lease",
        on_thread_exit: Callable[[], object] | None = None,
        on_thread_start: Callable[[], object] | None = None,
        close_timeout_s: float = 10.0,
    ) -> None:
        self.name = name
        self._on_thread_start = on_thread_start
        self._on_thread_exit = on_thread_exit
        self._close_timeout_s = close_timeout_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Guards every job's state, the counters below and _closed: the lease
        # thread and the Trio thread (and submit_nowait from any thread) race.
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread_id: int | None = None
        self._start_error: BaseException | None = None
        self._current: _Job | None = None
        self._queue_depth = 0
        self._jobs_run = self._jobs_failed = 0
        self._jobs_cancelled_queued = self._jobs_abandoned = 0
        self._busy_s = 0.0
        self._running_since: float | None = None
        self._started_at: float | None = None
        self._stopped_at: float | None = None

    # ---- the Trio side ------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False) -> T:
        """Run ``fn(*args)`` on the lease thread and return its result.

        The job waits behind every job submitted before it (FIFO). An exception
        from ``fn`` is re-raised here as the same object, its traceback still
        holding ``fn``'s frames; the lease keeps serving.

        Cancellation: a job still queued is withdrawn and never runs, and
        `trio.Cancelled` is raised at once. A running job cannot be interrupted.
        By default the caller waits for it, gets its result or error, and
        `trio.Cancelled` is raised at the next checkpoint, so nothing the job
        touches changes after `run` has left. With ``abandon_on_cancel=True``
        the caller leaves at once; the job still completes on the lease thread
        (later jobs still queue behind it), its result is dropped and its
        exception, if any, is logged and counted. Use it only when the job's
        state is then cleaned up through the lease (`submit_nowait`).

        Raises:
          LeaseClosed: the lease is not serving, is closing, or closed while the
            job was queued (or while it was running on a wedged thread).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        job = _Job(fn, args, trio.lowlevel.current_task())
        if not self._enqueue(job):
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise LeaseClosed(f"{self.name} is not serving")

        def abort(_: Any) -> trio.lowlevel.Abort:
            with self._lock:
                if job.state is _State.QUEUED:
                    job.state = _State.SKIPPED
                    self._queue_depth -= 1
                    self._jobs_cancelled_queued += 1
                    return trio.lowlevel.Abort.SUCCEEDED
                if not abandon_on_cancel:
                    return trio.lowlevel.Abort.FAILED
                # RUNNING, or DONE with delivery pending: _deliver drops it.
                job.detached = True
                self._jobs_abandoned += 1
                return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]

    def submit_nowait(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue ``fn(*args)`` on the lease thread without waiting for it.

        For cleanup that must happen on the lease thread, such as dropping a
        request's KV arrays. Runs in FIFO order with `run` jobs; its result is
        discarded and its exception logged and counted. Closing the lease still
        runs nowait jobs already queued. Safe to call from any thread.

        Raises:
          LeaseClosed: the lease is not serving or is closing.
        """
        if not self._enqueue(_Job(fn, args, None)):
            raise LeaseClosed(f"{self.name} is not serving")

    def on_lease_thread(self) -> bool:
        """Whether the calling thread is this lease's thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def statistics(self) -> LeaseStatistics:
        """Return a consistent snapshot of the counters (see `LeaseStatistics`)."""
        now = time.monotonic()
        with self._lock:
            busy_s = self._busy_s
            if self._running_since is not None:
                busy_s += now - self._running_since
            uptime_s = 0.0
            if self._started_at is not None:
                uptime_s = (self._stopped_at or now) - self._started_at
            return LeaseStatistics(
                queue_depth=self._queue_depth,
                mailbox_depth=self._queue_depth,
                jobs_run=self._jobs_run,
                jobs_failed=self._jobs_failed,
                jobs_cancelled_queued=self._jobs_cancelled_queued,
                jobs_abandoned=self._jobs_abandoned,
                busy_s=busy_s,
                busy_fraction=min(1.0, busy_s / uptime_s) if uptime_s > 0 else 0.0,
                running_since=self._running_since,
                thread_id=self._thread_id,
                alive=self._thread is not None and self._thread.is_alive(),
                closed=self._closed,
            )

    async def serve(self, *, task_status: trio.TaskStatus[GpuLease] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the lease thread, report ``started(self)``, serve until cancelled.

        ``task_status.started`` is called once the thread has run
        ``on_thread_start``. On cancellation the lease closes: new submissions
        raise `LeaseClosed`, queued `run` callers get `LeaseClosed` at once,
        queued `submit_nowait` jobs and the running job finish, then the thread
        runs ``on_thread_exit`` and ends. The wait for that is shielded and
        bounded by ``close_timeout_s``; if the thread is wedged the error is
        logged, the caller of the running job gets `LeaseClosed`, and the
        daemon thread is left behind (only a process restart recovers it).

        Raises:
          RuntimeError: this lease was already served once.
          BaseException: whatever ``on_thread_start`` raised.
        """
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was already served; make a new GpuLease")
        self._token = trio.lowlevel.current_trio_token()
        thread_ready = trio.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(thread_ready.set,), name=self.name, daemon=True)
        try:
            self._thread.start()
            await thread_ready.wait()
            if self._start_error is not None:
                raise self._start_error
            task_status.started(self)
            await trio.sleep_forever()
        finally:
            with trio.move_on_after(self._close_timeout_s, shield=True):
                self._close()
                # Joining is not MLX work, but polling keeps Trio's thread pool out.
                while self._thread.is_alive():
                    await trio.sleep(0.002)
            if self._thread.is_alive():
                self._fail_wedged_job()

    def _enqueue(self, job: _Job) -> bool:
        with self._lock:
            if self._closed or self._thread is None:
                return False
            self._queue_depth += 1
            # Under the lock so that _close's sentinel is always the last item.
            self._queue.put(job)
        return True

    def _close(self) -> None:
        """Stop intake, fail queued waiters with LeaseClosed, queue the stop sentinel."""
        with self._lock:
            self._closed = True
        nowait_jobs = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                continue
            if job.task is None:
                nowait_jobs.append(job)
                continue
            with self._lock:
                if job.state is not _State.QUEUED:
                    continue  # withdrawn by its cancelled caller, already woken
                job.state = _State.SKIPPED
                self._queue_depth -= 1
            trio.lowlevel.reschedule(job.task, outcome.Error(LeaseClosed(f"{self.name} closed")))
        for job in nowait_jobs:
            self._queue.put(job)
        self._queue.put(_STOP)

    def _fail_wedged_job(self) -> None:
        log.error(
            "%s: lease thread still running a job %.1f s after close; it is wedged "
            "and only a process restart recovers it",
            self.name,
            self._close_timeout_s,
        )
        with self._lock:
            job = self._current
            if job is None or job.task is None or job.detached or job.state is not _State.RUNNING:
                return
            job.detached = True
        trio.lowlevel.reschedule(job.task, outcome.Error(LeaseClosed(f"{self.name} wedged")))

    def _deliver(self, job: _Job, result: outcome.Outcome[Any]) -> None:
        # Runs on the Trio thread (run_sync_soon), so `detached` needs no lock;
        # it must not raise, or the Trio run crashes.
        if not job.detached:
            assert job.task is not None
            trio.lowlevel.reschedule(job.task, result)
        elif isinstance(result, outcome.Error):
            log.error("%s: abandoned job %s failed", self.name, job.name, exc_info=result.error)

    # ---- the lease thread ---------------------------------------------------

    def _thread_main(self, report_ready: Callable[[], None]) -> None:
        assert self._token is not None
        self._thread_id = threading.get_ident()
        self._started_at = time.monotonic()
        try:
            if self._on_thread_start is not None:
                try:
                    self._on_thread_start()
                except BaseException as exc:
                    self._start_error = exc
            try:
                self._token.run_sync_soon(report_ready)
            except trio.RunFinishedError:
                return
            if self._start_error is None:
                self._serve_jobs()
        finally:
            with self._lock:
                self._closed = True  # a job queued now would never run
            if self._on_thread_exit is not None:
                try:
                    self._on_thread_exit()
                except BaseException:
                    log.exception("%s: on_thread_exit failed", self.name)
            with self._lock:
                self._stopped_at = time.monotonic()

    def _serve_jobs(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            with self._lock:
                if job.state is not _State.QUEUED:
                    continue
                job.state = _State.RUNNING
                self._queue_depth -= 1
                self._current = job
                self._running_since = time.monotonic()
            if not self._run_job(job):
                return

    def _run_job(self, job: _Job) -> bool:
        """Run one job and hand its outcome over; False once the Trio run is gone.

        A separate frame so that the arguments and the outcome are released on
        this thread when it returns: MLX objects that only the job kept alive
        are freed here, not wherever the last reference happens to go.
        """
        assert self._token is not None and job.fn is not None
        result = outcome.capture(job.fn, *job.args)
        job.fn, job.args = None, ()
        with self._lock:
            job.state = _State.DONE
            self._current = None
            assert self._running_since is not None
            self._busy_s += time.monotonic() - self._running_since
            self._running_since = None
            self._jobs_run += 1
            if isinstance(result, outcome.Error):
                self._jobs_failed += 1
        if job.task is None:
            if isinstance(result, outcome.Error):
                log.error("%s: submit_nowait job %s failed", self.name, job.name, exc_info=result.error)
            return True
        try:
            self._token.run_sync_soon(self._deliver, job, result)
        except trio.RunFinishedError:
            return False  # nobody is left to deliver to
        return True


@asynccontextmanager
async def open_gpu_lease(**kwargs: Any) -> AsyncIterator[GpuLease]:
    """Serve a `GpuLease` (built from ``kwargs``) for the duration of the block.

    Leaving the block closes the lease as described in `GpuLease.serve`.
    """
    async with trio.open_nursery() as nursery:
        lease: GpuLease = await nursery.start(GpuLease(**kwargs).serve)
        try:
            yield lease
        finally:
            nursery.cancel_scope.cancel()
