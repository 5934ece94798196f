"""Recording children for the supervision tests: every lifecycle step lands in one log."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from mlx_trio.supervision import ChildSpec, Restart


@attrs.frozen
class WorkerStatistics:
    """What a recording worker reports to the status tree."""

    mailbox_depth: int
    served: int


class Worker:
    """One incarnation of a recording child; the test tells it to crash or return."""

    def __init__(self, name: str) -> None:
        self.name = name
        # 1: a test sends at most one outcome per incarnation.
        self._outcome_send, self._outcome_recv = trio.open_memory_channel[Exception | None](1)

    def crash(self, error: Exception | None = None) -> None:
        """Make this incarnation raise `error` (default ``ValueError("boom")``)."""
        self._outcome_send.send_nowait(error if error is not None else ValueError("boom"))

    def finish(self) -> None:
        """Make this incarnation return normally."""
        self._outcome_send.send_nowait(None)

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(mailbox_depth=self._outcome_recv.statistics().current_buffer_used, served=7)

    async def serve(self, log: list[str]) -> None:
        try:
            outcome = await self._outcome_recv.receive()
        except trio.Cancelled:
            log.append(f"stop {self.name}")
            raise
        if outcome is not None:
            log.append(f"crash {self.name}")
            raise outcome
        log.append(f"return {self.name}")


def recording(
    name: str,
    log: list[str],
    *,
    fail_next_start: set[str] | None = None,
    **spec_kwargs: Any,
) -> ChildSpec:
    """Return a spec whose incarnations log ``start``/``stop``/``crash``/``return`` lines.

    A name in `fail_next_start` makes the next start of that child raise before
    ``started()`` (logged as ``start-failed``), and is then removed from the set.
    """

    async def start(*, task_status: trio.TaskStatus[Worker] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.lowlevel.checkpoint()
        if fail_next_start is not None and name in fail_next_start:
            fail_next_start.discard(name)
            log.append(f"start-failed {name}")
            raise RuntimeError(f"{name} cannot start")
        worker = Worker(name)
        log.append(f"start {name}")
        task_status.started(worker)
        await worker.serve(log)

    spec_kwargs.setdefault("restart", Restart.PERMANENT)
    return ChildSpec(id=name, start=start, **spec_kwargs)
