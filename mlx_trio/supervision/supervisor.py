"""`Supervisor`: OTP supervision (strategies, restart types, intensity) on a Trio nursery."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import trio

from mlx_trio.supervision.child import Child, Exited, describe_error, logger, run_child, stop_child
from mlx_trio.supervision.errors import SupervisorGaveUp
from mlx_trio.supervision.restart import Backoff, RestartIntensity, affected
from mlx_trio.supervision.spec import ChildSpec, Restart, Strategy
from mlx_trio.supervision.status import child_entry, handle_stats

SupervisorState = Literal["starting", "running", "stopping", "stopped", "failed"]


@attrs.define(eq=False)
class _Run:
    """Everything one call of `Supervisor.run` owns; a restarted supervisor gets a new one.

    Keeping it per run means a previous run still waiting in its nursery for a child
    that ignores cancellation never shares children or counters with the next run.
    """

    nursery: trio.Nursery
    exits: trio.MemorySendChannel[Exited]
    # Insertion order is start order: restarts keep their place, new children append.
    children: dict[str, Child]
    started_at: float
    intensity: RestartIntensity
    state: SupervisorState = "starting"
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    done: trio.Event = attrs.field(factory=trio.Event)
    # Serialises changes to `children` between the control loop and the
    # start_child/terminate_child callers, so a restart never sees half a change.
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    restarts: int = 0
    ended_temporary: int = 0


class Supervisor:
    """Starts children in order, restarts them per `strategy`, stops them in reverse.

    ``await sup.run()`` (or ``await nursery.start(sup.run)``, which returns `sup`
    once every child is ready) supervises until cancelled or `stop` is called;
    either stops the children in reverse start order, each with its own bounded
    ladder (see `ChildSpec.shutdown_s`), and returns. If a child fails to start at
    startup, the started ones are stopped and `run` raises the child's exception.
    More than `max_restarts` restarts within `period_s` seconds stop everything and
    raise `SupervisorGaveUp`. `backoff` spaces the restarts of a child that keeps
    crashing right after it starts (default: never waits). Use `as_child` to nest a
    supervisor in another one, `Retrying` to run one that survives its giving up.
    """

    def __init__(
        self,
        id: str,
        children: Sequence[ChildSpec] = (),
        *,
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        max_restarts: int = 3,
        period_s: float = 5.0,
        backoff: Backoff = Backoff(),
    ) -> None:
        ids = [spec.id for spec in children]
        if len(set(ids)) != len(ids):
            raise ValueError(f"supervisor {id!r}: duplicate child ids in {ids}")
        self.id = id
        self.strategy = strategy
        self.max_restarts = max_restarts
        self.period_s = period_s
        self.backoff = backoff
        self._specs = tuple(children)
        self._run: _Run | None = None

    def as_child(self, *, restart: Restart = Restart.PERMANENT, shutdown_s: float = math.inf) -> ChildSpec:
        """Return a spec that runs this supervisor as a child of another one.

        The handle is this `Supervisor`. Each restart calls `run` again, which starts
        fresh children from the specs given to ``__init__`` (dynamic children are
        not carried over). `shutdown_s` defaults to ``math.inf`` (OTP's
        ``infinity``): this supervisor already bounds each of its own children's
        stop, and the parent must not stop older siblings before it has finished.
        """
        return ChildSpec(id=self.id, start=self.run, restart=restart, shutdown_s=shutdown_s, kind="supervisor")

    async def run(self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the children in order, report ready with ``started(self)``, supervise.

        Returns after `stop`; raises `trio.Cancelled` when cancelled, after the
        children have stopped; raises `SupervisorGaveUp` when the restart intensity
        is exceeded, or a child's exception when it fails to start at startup.
        """
        if self._run is not None and self._run.state in ("starting", "running"):
            raise RuntimeError(f"supervisor {self.id!r} is already running")
        exits_send, exits_recv = trio.open_memory_channel[Exited](0)
        # Buffer 0: a child's task waits in send until the loop takes its exit, so
        # pending exits are bounded by the live children, never by a buffer.
        failure: BaseException | None = None
        run: _Run | None = None
        try:
            async with trio.open_nursery() as nursery:
                children = {spec.id: Child(spec) for spec in self._specs}
                intensity = RestartIntensity(self.max_restarts, self.period_s)
                run = self._run = _Run(nursery, exits_send, children, trio.current_time(), intensity)
                with run.scope:
                    try:
                        failure = await self._start_initial(run)
                        if failure is None:
                            run.state = "running"
                            task_status.started(self)
                            await self._supervise(run, exits_recv)
                    except SupervisorGaveUp as exc:
                        failure = exc
                    finally:
                        run.state = "stopping"
                        # Bounded by the children's shutdown_s; must finish even
                        # when this task is being cancelled.
                        with trio.CancelScope(shield=True):
                            await self._stop_all(run)
        finally:
            exits_send.close()
            exits_recv.close()
            if run is not None:
                run.state = "stopped" if failure is None else "failed"
                run.done.set()
        if failure is not None:
            raise failure

    async def stop(self) -> None:
        """Stop all children in reverse start order and wait until `run` has returned.

        Does nothing if the supervisor is not running. Must not be called from one of
        this supervisor's own children: `run` waits for them.
        """
        run = self._run
        if run is None:
            return
        run.scope.cancel()
        await run.done.wait()

    async def start_child(self, spec: ChildSpec) -> object:
        """Start a child after startup, last in start order, and return its handle.

        Waits for any restart in progress, then for the child's ``started()``.
        Raises ``ValueError`` if a live child already has ``spec.id`` (callers make
        ids unique), ``RuntimeError`` if the supervisor is not running, and whatever
        the child raised if it fails to start (nothing is then kept or retried).
        """
        run = self._running()
        async with run.lock:
            self._running()
            if spec.id in run.children:
                raise ValueError(f"supervisor {self.id!r} already has a child {spec.id!r}")
            child = run.children[spec.id] = Child(spec)
            try:
                return await self._start(run, child)
            except BaseException:
                if run.children.get(spec.id) is child:
                    del run.children[spec.id]
                raise

    async def terminate_child(self, id: str) -> None:
        """Stop the child `id` with its shutdown ladder and forget it.

        Never restarts it. Does nothing if there is no such child (it may just have
        ended on its own), so ending a session twice is harmless.
        """
        run = self._run
        if run is None or run.state not in ("starting", "running"):
            return
        async with run.lock:
            child = run.children.get(id)
            if child is None:
                return
            await stop_child(child)
            if run.children.get(id) is child:
                self._forget(run, child)

    def handle(self, id: str) -> object | None:
        """Return the handle of child `id` while it is running, else ``None``."""
        child = self._run.children.get(id) if self._run is not None else None
        return child.handle if child is not None else None

    def liveness(self) -> tuple[str, list[str]]:
        """This supervisor's state and the ids of its children that are not running: what `status()` says
        of them, without building it (every request's submit asks, through the engine's health)."""
        run = self._run
        if run is None:
            return "stopped", []
        return run.state, [child.spec.id for child in run.children.values() if child.state != "running"]

    def status(self) -> dict[str, Any]:
        """Return the live supervision tree as JSON-able data (call inside Trio).

        A child whose handle is a `Supervisor` has that supervisor's status merged
        in (its ``children``, ``strategy``...), keeping the parent's view of the
        child's ``state``, ``restarts`` and ``uptime_s``; the nested supervisor's
        own restart total appears as ``restarts_performed``. Other handles with a
        ``statistics()`` method contribute ``stats`` (and ``mailbox_depth``).
        """
        run, now = self._run, trio.current_time()
        entries = []
        for child in run.children.values() if run is not None else ():
            entry = child_entry(child, now)
            if isinstance(child.handle, Supervisor):
                nested = child.handle.status()
                entry = {**nested, **entry, "restarts_performed": nested["restarts"]}
            elif child.handle is not None:
                entry.update(handle_stats(child.handle))
            entries.append(entry)
        return {
            "id": self.id,
            "kind": "supervisor",
            "strategy": self.strategy.value,
            "state": run.state if run is not None else "stopped",
            "restarts": run.restarts if run is not None else 0,
            "max_restarts": self.max_restarts,
            "period_s": self.period_s,
            "uptime_s": now - run.started_at if run is not None and run.state == "running" else None,
            "ended_temporary": run.ended_temporary if run is not None else 0,
            "children": entries,
        }

    def _running(self) -> _Run:
        if self._run is None or self._run.state != "running":
            raise RuntimeError(f"supervisor {self.id!r} is not running")
        return self._run

    async def _start(self, run: _Run, child: Child) -> object:
        """Start one incarnation of `child`; re-raise its start failure after recording it."""
        child.begin()
        try:
            handle = await run.nursery.start(run_child, child, run.exits)
        except Exception as exc:
            child.last_error = describe_error(exc)
            child.mark_exited("failed")
            logger.warning("child %r of %r failed to start: %s", child.spec.id, self.id, child.last_error)
            raise
        # Sessions start by the thousand: their starts are debug noise, not news.
        level = logging.DEBUG if child.spec.restart is Restart.TEMPORARY else logging.INFO
        logger.log(level, "child %r of %r started (restarts: %d)", child.spec.id, self.id, child.restarts)
        return handle

    async def _start_in_order(self, run: _Run, children: list[Child]) -> tuple[Child, Exception] | None:
        """Start `children` in order; stop at the first failure and return it."""
        for child in children:
            try:
                await self._start(run, child)
            except Exception as exc:
                return child, exc
        return None

    async def _start_initial(self, run: _Run) -> Exception | None:
        """Start the static children in order; return the first start failure, if any."""
        failed = await self._start_in_order(run, list(run.children.values()))
        if failed is None:
            return None
        logger.error("supervisor %r could not start child %r", self.id, failed[0].spec.id)
        return failed[1]

    async def _stop_all(self, run: _Run) -> None:
        """Stop every child in reverse start order, each with its own bounded ladder."""
        for child in reversed(list(run.children.values())):
            await stop_child(child)

    def _forget(self, run: _Run, child: Child) -> None:
        """Drop `child` for good; an ended temporary child leaves only a count behind."""
        del run.children[child.spec.id]
        if child.spec.restart is Restart.TEMPORARY:
            run.ended_temporary += 1

    async def _supervise(self, run: _Run, exits: trio.MemoryReceiveChannel[Exited]) -> None:
        """The control loop: handle each child's exit, one at a time, until cancelled."""
        # Not `async for`: its loop variable would pin the last ended child in memory.
        while True:
            await self._on_exit(run, await exits.receive())

    async def _on_exit(self, run: _Run, exited: Exited) -> None:
        """Apply the child's restart type, then the strategy if it must restart."""
        async with run.lock:
            child = exited.child
            if run.children.get(child.spec.id) is not child or child.incarnation != exited.incarnation:
                return  # terminated while its exit was on its way
            restart = child.spec.restart
            if restart is Restart.TEMPORARY:
                self._forget(run, child)
            elif restart is Restart.PERMANENT or exited.error is not None:
                child.crash_streak = self.backoff.streak(child.crash_streak, exited.uptime_s)
                await self._restart(run, child, exited.error)

    async def _restart(self, run: _Run, child: Child, error: Exception | None) -> None:
        """Restart per the strategy; a failed start counts as that child's next crash.

        Raises `SupervisorGaveUp` (children are stopped by `run`) once the restart
        intensity is exceeded.
        """
        while True:
            if not run.intensity.add(trio.current_time()):
                reason = describe_error(error) if error is not None else "returned"
                logger.error("supervisor %r gave up after child %r exited: %s", self.id, child.spec.id, reason)
                gave_up = SupervisorGaveUp(self.id, child.spec.id, self.max_restarts, self.period_s)
                gave_up.__cause__ = error
                raise gave_up
            run.restarts += 1
            delay = self.backoff.delay_s(child.crash_streak)
            if delay > 0:
                logger.info("supervisor %r: child %r crashed %d times in a row soon after starting; restarting "
                            "in %.2f s", self.id, child.spec.id, child.crash_streak, delay)
                await trio.sleep(delay)
            to_stop = affected(self.strategy, list(run.children.values()), child)
            for sibling in reversed(to_stop):
                await stop_child(sibling)
            to_start = []
            for sibling in to_stop:
                # OTP: temporary siblings are dropped rather than restarted.
                if sibling is not child and sibling.spec.restart is Restart.TEMPORARY:
                    self._forget(run, sibling)
                else:
                    sibling.state = "restarting"
                    to_start.append(sibling)
            logger.info("supervisor %r restarting %s", self.id, [c.spec.id for c in to_start])
            failed = await self._start_in_order(run, to_start)
            if failed is None:
                return
            child, error = failed
            child.crash_streak = self.backoff.streak(child.crash_streak, 0.0)  # a failed start is a quick crash
