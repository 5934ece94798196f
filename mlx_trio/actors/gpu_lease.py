"""The GPU lease: one dedicated OS thread that runs every MLX call of the process.

MLX binds streams to the thread that made them (a lazy array built in one thread
cannot be evaluated in another), and `trio.to_thread` moves work between pooled
threads, so the lease owns one daemon thread for its whole life and feeds it jobs
in FIFO order. Callers park in `trio.lowlevel.wait_task_rescheduled` and are woken
through the run's `TrioToken`. No MLX import here: MLX thread set-up and tear-down
are injected (`mlx_trio.engine.lease_thread`). Contract and numbers: docs/gpu-lease.md.
"""

from __future__ import annotations

import enum
import functools
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

from mlx_trio import profiling
from mlx_trio.engine import spans
from mlx_trio.errors import LeaseClosed
from mlx_trio.supervision.faults import FaultKind, Faults, InjectedFault

log = logging.getLogger(__name__)
T = TypeVar("T")
_STOP = object()  # queue sentinel: the lease thread runs on_thread_exit and ends
_CONTINUED = object()  # a chain link's result when it queued the next link: nothing to deliver


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    SKIPPED = "skipped"  # withdrawn by a cancelled caller or failed at close; never runs


@attrs.define(eq=False)
class _Job:
    """One call waiting for or running on the lease thread."""

    fn: Callable[..., Any] | None  # None once run, so its arguments die on the lease thread
    args: tuple[Any, ...]
    task: trio.lowlevel.Task | None  # None for chain/submit_nowait: no task is parked on it
    name: str  # for log messages
    chain: LeaseChain | None = None  # set for a chain's links: the chain's outcome goes there
    # A chain's own link: it calls the chain's function through `run_job` itself, once per run.
    direct: bool = False
    # Invariant: changed only under GpuLease._lock; QUEUED -> RUNNING -> DONE by the
    # lease thread, QUEUED -> SKIPPED by the Trio thread (cancelled caller, close).
    state: _State = _State.QUEUED
    # Set on the Trio thread when the waiter has left: the outcome must be dropped.
    detached: bool = False


def _job(fn: Callable[..., Any], args: tuple[Any, ...], task: trio.lowlevel.Task | None) -> _Job:
    name = _name(fn)
    # A wrapper job (chunk_sizer.timed) is named after what it wraps too, so the job log tells them apart.
    if getattr(fn, "names_its_first_argument", False) and args and callable(args[0]):
        name = f"{name}({_name(args[0])})"
    return _Job(fn, args, task, name)


def _name(fn: Callable[..., Any]) -> str:
    """A job's name for logs: never `repr` of a partial, whose arguments may be a model and a long prompt."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


class LeaseChain:
    """`GpuLease.chain`'s handle: stop the chain, wait for its end (delivered on the Trio thread)."""

    def __init__(self) -> None:
        self._done = trio.Event()
        self._outcome: outcome.Outcome[object] | None = None
        # Written on the Trio thread, read by the lease thread between links (a plain bool: the GIL orders it).
        self.stopping = False

    def stop(self) -> None:
        """No link starts after the one running now; `wait` returns once that one is over. Safe from any thread."""
        self.stopping = True

    async def wait(self) -> None:
        """Until the chain ends: `stop()`, or a link returned False; re-raises what a link raised.

        Leaving this wait (cancellation) does not stop the chain: call `stop()`.

        Raises:
          LeaseClosed: the lease closed before the chain ended.
        """
        await self._done.wait()
        assert self._outcome is not None
        self._outcome.unwrap()

    def _set(self, result: outcome.Outcome[object]) -> None:
        if self._outcome is None:
            self._outcome = result
            self._done.set()


@attrs.frozen
class LeaseStatistics:
    """A snapshot of a `GpuLease`, for the status tree and the watchdog."""

    queue_depth: int  # jobs waiting in the queue, not counting the running one
    mailbox_depth: int  # the same number, under the name the supervision tree reads
    jobs_run: int  # jobs whose function was called (and returned or raised)
    jobs_failed: int  # of those, the jobs whose function raised
    jobs_cancelled_queued: int  # jobs withdrawn by a cancelled caller before they ran
    jobs_abandoned: int  # running jobs whose caller left (abandon_on_cancel=True)
    busy_s: float  # seconds spent running jobs, the current one included
    busy_fraction: float  # busy_s over the thread's uptime; 0 before it starts
    # time.monotonic() at which the current job started, None when idle: a value
    # far in the past means the thread is wedged.
    running_since: float | None
    thread_id: int | None  # threading.get_ident() of the lease thread; None before start
    alive: bool  # whether the lease thread is running
    closed: bool  # whether the lease refuses new jobs


class GpuLease:
    """Runs callables one at a time, in submission order, on one dedicated thread.

    Every MLX call of the process (loading, graph building, eval, freeing) goes
    through `run` or `submit_nowait`, so all of it runs on one OS thread and its
    streams, from `serve`'s start to its cancellation. A closed lease never
    reopens: serve a new one (a new thread; only *evaluated* arrays carry over).

    Args:
      name: the thread's name, also used in log messages.
      on_thread_exit: called last on the lease thread, also after a failed start.
        For MLX pass `mlx_trio.engine.lease_thread.release_thread_streams`.
      on_thread_start: called first on the lease thread; if it raises, `serve`
        raises that error instead of reporting started.
      close_timeout_s: how long closing waits for the running job and the
        thread's exit before declaring the thread wedged.
      run_job: calls each job's function with its arguments, on the lease
        thread, and returns its result; plain ``fn(*args)`` by default. Scale-out
        passes rank 0's broadcast (`mlx_trio.engine.distributed.leader`), so
        every rank runs every job and nothing else here changes.
    """

    def __init__(self, *, name: str = "gpu-lease", on_thread_exit: Callable[[], object] | None = None,
                 on_thread_start: Callable[[], object] | None = None, close_timeout_s: float = 10.0,
                 faults: Faults | None = None,
                 run_job: Callable[[Callable[..., Any], tuple[Any, ...]], Any] | None = None) -> None:
        self.name = name
        self._call = run_job or _call
        self._faults = faults
        # Set by abandon(): releases an injected hang, and tells serve() not to wait for the thread.
        self._abandoned = threading.Event()
        self._on_thread_start = on_thread_start
        self._on_thread_exit = on_thread_exit
        self._close_timeout_s = close_timeout_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Guards job states, _closed, _current and the counters: the lease thread,
        # the Trio thread and submit_nowait callers on any thread all touch them.
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread_id: int | None = None
        self._start_error: BaseException | None = None
        self._current: _Job | None = None
        self._queue_depth = self._jobs_run = self._jobs_failed = 0
        self._jobs_cancelled_queued = self._jobs_abandoned = 0
        self._busy_s = 0.0
        self._running_since: float | None = None
        self._started_at: float | None = None
        self._stopped_at: float | None = None
        # A profiler's seam (benchmarks/stall_profile.py, MLX_TRIO_PROFILE): when set, every job
        # appends (name, start, end) here, in time.perf_counter() seconds.
        self.job_log: list[tuple[str, float, float]] | None = profiling.shared_job_log()
        if self.job_log is not None:
            spans.log_to(profiling.shared_span_log())  # parts of jobs, where the engine marks them

    async def run(self, fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False) -> T:
        """Run ``fn(*args)`` on the lease thread, after every job submitted before it.

        Returns ``fn``'s result, or re-raises its exception: the same object,
        its traceback still holding ``fn``'s frames. The lease keeps serving.

        Cancellation: a job still queued is withdrawn and never runs, and
        `trio.Cancelled` is raised at once. A running job cannot be interrupted:
        by default the caller waits for it, gets its result or error, and
        `trio.Cancelled` is raised at the next checkpoint, so nothing the job
        touches changes after `run` returns. With ``abandon_on_cancel=True`` the
        caller leaves at once; the job completes on the thread (later jobs still
        wait for it), its result is dropped, its exception logged and counted.
        Clean up such a job's state through the lease (`submit_nowait`).

        Raises:
          LeaseClosed: the lease is not serving, or closed while the job was
            queued, or the thread was declared wedged while the job ran.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        fn, args = self._maybe_inject(fn, args)
        job = _job(fn, args, trio.lowlevel.current_task())
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
                # RUNNING, or DONE with delivery pending: _deliver drops the outcome.
                job.detached = True
                self._jobs_abandoned += 1
                return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]

    def _maybe_inject(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """Swap the job for an injected fault, if one is armed for this lease (tests and drills)."""
        if self._faults is None:
            return fn, args
        if self._faults.take(self.name, FaultKind.RAISE):
            return _raise_injected, (self.name,)
        if self._faults.take(self.name, FaultKind.HANG):
            return self._abandoned.wait, ()  # blocks the thread until the watchdog abandons it
        return fn, args

    def abandon(self) -> None:
        """Declare the thread wedged: fail every waiter with `LeaseClosed` and stop waiting for it.

        The watchdog calls this when a job has run far too long. The thread is
        left behind (a daemon; logged); the supervisor starts a new lease.
        """
        log.error("%s: abandoning the lease thread (a job ran past the watchdog)", self.name)
        self._abandoned.set()
        self._close()
        self._fail_wedged_job()

    def chain(self, fn: Callable[..., bool], *args: Any) -> LeaseChain:
        """Run ``fn(*args)`` on the lease thread again and again until it returns False, raises, or `stop()`.

        The lease thread queues each next run itself, at the tail of the
        queue: jobs submitted while a run was going run before the next one
        (FIFO, so a prefill chunk interleaves with decode steps), and between
        runs nothing waits for Trio. A run that ends the chain delivers its
        outcome to the handle's `wait`; a run that goes on delivers nothing,
        so the Trio thread is not woken per run (the decode step chain:
        actors/decode_step.py). Fault injection applies to every run.

        Raises:
          LeaseClosed: the lease is not serving.
        """
        handle = LeaseChain()
        if not self._enqueue(self._chain_link(handle, fn, args)):
            raise LeaseClosed(f"{self.name} is not serving")
        return handle

    def _chain_link(self, handle: LeaseChain, fn: Callable[..., bool], args: tuple[Any, ...]) -> _Job:
        def link() -> object:
            if handle.stopping or not self._call(fn, args) or handle.stopping:
                return None
            if not self._enqueue(self._chain_link(handle, fn, args)):
                raise LeaseClosed(f"{self.name} closed")
            return _CONTINUED

        run, run_args = self._maybe_inject(link, ())
        return _Job(run, run_args, None, _name(fn), chain=handle, direct=run is link)

    def to_trio_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """From a job on the lease thread: run ``fn(*args)`` on the Trio thread soon.

        In order with every other delivery from this thread, so it runs before
        the job's own result reaches its caller. ``fn`` runs in Trio's run loop,
        not in a task: it must not block, and it must not raise (that would
        crash the Trio run).
        """
        assert self._token is not None
        self._token.run_sync_soon(fn, *args)

    def submit_nowait(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue ``fn(*args)`` on the lease thread and return at once; safe from any thread.

        For cleanup that must happen on the lease thread, such as dropping a
        request's KV arrays. FIFO with `run` jobs; the result is discarded, an
        exception is logged and counted. Closing still runs queued nowait jobs.

        Raises:
          LeaseClosed: the lease is not serving or is closing.
        """
        if not self._enqueue(_job(fn, args, None)):
            raise LeaseClosed(f"{self.name} is not serving")

    def free_nowait(self, close: Callable[[], object]) -> None:
        """Run `close` (dropping some arrays) on the lease thread, which owns them; no-op once closed.

        For `finally` blocks: when the lease is gone, so is every array its thread owned.
        """
        try:
            self.submit_nowait(close)
        except LeaseClosed:
            pass

    def on_lease_thread(self) -> bool:
        """Whether the calling thread is this lease's thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def statistics(self) -> LeaseStatistics:
        """Return a consistent snapshot of the counters (see `LeaseStatistics`)."""
        now = time.monotonic()
        with self._lock:
            busy_s = self._busy_s + (now - self._running_since if self._running_since is not None else 0.0)
            uptime_s = (self._stopped_at or now) - self._started_at if self._started_at is not None else 0.0
            return LeaseStatistics(
                queue_depth=self._queue_depth, mailbox_depth=self._queue_depth,
                jobs_run=self._jobs_run, jobs_failed=self._jobs_failed,
                jobs_cancelled_queued=self._jobs_cancelled_queued, jobs_abandoned=self._jobs_abandoned,
                busy_s=busy_s, busy_fraction=min(1.0, busy_s / uptime_s) if uptime_s > 0 else 0.0,
                running_since=self._running_since, thread_id=self._thread_id,
                alive=self._thread is not None and self._thread.is_alive(), closed=self._closed,
            )

    async def serve(self, *, task_status: trio.TaskStatus[GpuLease] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the lease thread, report ``started(self)``, and serve until cancelled.

        ``started`` is reported once the thread has run ``on_thread_start``. On
        cancellation the lease closes: new submissions raise `LeaseClosed`,
        queued `run` callers get `LeaseClosed` at once, queued `submit_nowait`
        jobs and the running job finish, then the thread runs ``on_thread_exit``
        and ends. That wait is shielded and bounded by ``close_timeout_s``; past
        it the thread is declared wedged: an error is logged, the running job's
        caller gets `LeaseClosed`, and the daemon thread is left behind (only a
        process restart recovers the device).

        Raises:
          RuntimeError: this lease was already served.
          BaseException: whatever ``on_thread_start`` raised.
        """
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was already served; make a new GpuLease")
        self._token = trio.lowlevel.current_trio_token()
        ready = trio.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(ready.set,), name=self.name, daemon=True)
        try:
            self._thread.start()
            await ready.wait()
            if self._start_error is not None:
                raise self._start_error
            task_status.started(self)
            await trio.sleep_forever()
        finally:
            with trio.move_on_after(0 if self._abandoned.is_set() else self._close_timeout_s, shield=True):
                self._close()
                # Poll rather than join: joining would block the loop or take a to_thread worker.
                while self._thread.is_alive():
                    await trio.sleep(0.002)
            if self._thread.is_alive() and not self._abandoned.is_set():  # abandon() already did this
                self._fail_wedged_job()

    def _enqueue(self, job: _Job) -> bool:
        with self._lock:
            if self._closed or self._thread is None:
                return False
            self._queue_depth += 1
            self._queue.put(job)  # under the lock, so _close's _STOP is always last
        return True

    def _close(self) -> None:
        """Stop intake, fail queued `run` callers and chains with LeaseClosed, queue _STOP."""
        with self._lock:
            self._closed = True
        keep: list[_Job] = []  # nowait cleanup jobs still run, in their order
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                continue
            if job.task is None and job.chain is None:
                keep.append(job)
                continue
            with self._lock:
                if job.state is not _State.QUEUED:
                    continue  # its cancelled caller withdrew it and was already woken
                job.state = _State.SKIPPED
                self._queue_depth -= 1
            closed = outcome.Error(LeaseClosed(f"{self.name} closed"))
            if job.chain is not None:
                job.chain._set(closed)
            else:
                trio.lowlevel.reschedule(job.task, closed)
        for job in keep:
            self._queue.put(job)
        self._queue.put(_STOP)

    def _fail_wedged_job(self) -> None:
        log.error("%s: the lease thread is still busy %.1f s after close: wedged; only a process "
                  "restart recovers it", self.name, self._close_timeout_s)
        with self._lock:
            job = self._current
            if job is not None and job.chain is not None and job.state is _State.RUNNING:
                job.chain._set(outcome.Error(LeaseClosed(f"{self.name} wedged")))
                return
            if job is None or job.task is None or job.detached or job.state is not _State.RUNNING:
                return
            job.detached = True
        trio.lowlevel.reschedule(job.task, outcome.Error(LeaseClosed(f"{self.name} wedged")))

    def _deliver(self, job: _Job, result: outcome.Outcome[Any]) -> None:
        # Runs on the Trio thread (run_sync_soon), as does every write of `detached`,
        # so no lock. It must not raise: that would crash the Trio run.
        if not job.detached:
            assert job.task is not None
            trio.lowlevel.reschedule(job.task, result)
        elif isinstance(result, outcome.Error):
            log.error("%s: abandoned job %s failed", self.name, job.name, exc_info=result.error)

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
            self._token.run_sync_soon(report_ready)
            if self._start_error is None:
                self._serve_jobs()
        except trio.RunFinishedError:
            pass  # the Trio run is gone: nobody is left to serve or to deliver to
        finally:
            with self._lock:
                self._closed = True  # a job queued from now on would never run
            if self._on_thread_exit is not None:
                try:
                    self._on_thread_exit()
                except BaseException:
                    log.exception("%s: on_thread_exit failed", self.name)
            with self._lock:
                self._stopped_at = time.monotonic()

    def _serve_jobs(self) -> None:
        while (job := self._queue.get()) is not _STOP:
            with self._lock:
                if job.state is not _State.QUEUED:
                    continue
                job.state = _State.RUNNING
                self._queue_depth -= 1
                self._current = job
                self._running_since = time.monotonic()
            self._run_job(job)

    def _run_job(self, job: _Job) -> None:
        # Drops fn and args right after the call, so MLX objects that only the job
        # kept alive (a bound method's owner, say) are freed on this thread.
        assert self._token is not None and job.fn is not None and self._running_since is not None
        start = time.perf_counter()
        result = outcome.capture(job.fn, *job.args) if job.direct else outcome.capture(self._call, job.fn, job.args)
        if self.job_log is not None:
            self.job_log.append((job.name, start, time.perf_counter()))
        job.fn, job.args = None, ()
        with self._lock:
            job.state = _State.DONE
            self._current = None
            self._busy_s += time.monotonic() - self._running_since
            self._running_since = None
            self._jobs_run += 1
            self._jobs_failed += isinstance(result, outcome.Error)
        if job.task is not None:
            self._token.run_sync_soon(self._deliver, job, result)
        elif job.chain is not None:
            if not (isinstance(result, outcome.Value) and result.value is _CONTINUED):  # the chain ended
                self._token.run_sync_soon(job.chain._set, result)
        elif isinstance(result, outcome.Error):
            log.error("%s: submit_nowait job %s failed", self.name, job.name, exc_info=result.error)


def _call(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    return fn(*args)


def _raise_injected(name: str) -> None:
    raise InjectedFault(f"fault injected into a {name} job")


@asynccontextmanager
async def open_gpu_lease(**kwargs: Any) -> AsyncIterator[GpuLease]:
    """Serve a `GpuLease(**kwargs)` for the duration of the block, then close it.

    Closing follows `GpuLease.serve`; it is shielded and bounded, so leaving the
    block on cancellation still stops the thread.
    """
    async with trio.open_nursery() as nursery:
        lease: GpuLease = await nursery.start(GpuLease(**kwargs).serve)
        try:
            yield lease
        finally:
            nursery.cancel_scope.cancel()
