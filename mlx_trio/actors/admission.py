"""The admission actor: FIFO, head-of-line, never reordered (docs/design.md §1).

A queued request is admitted when fewer than `max_rows` rows are in flight
(prefilling or decoding) and its projected worst-case KV bytes fit the budget
next to those already reserved. A request that could never fit, even alone,
is refused at once with an actionable error instead of blocking the queue
forever. Reserved bytes are released when the row is gone, so admission
holds nothing for finished or evicted rows (`Lane.end_request` releases them).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from mlx_trio.actors.block_persistence import BlockPersistenceActor
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.messages import Generate, GenerationEnded
from mlx_trio.engine.kv.layout import device_memory_reading
from mlx_trio.errors import LeaseClosed, Overloaded, RequestError
from mlx_trio.events import FinishReason

log = logging.getLogger("mlx_trio.admission")

# How often the budget is checked against the memory the device has free (actors/memory_budget.py).
MEMORY_FOLLOW_S = 1.0
# A request refused because the device is short of memory now: when to try again.
MEMORY_RETRY_AFTER_S = 5.0



@attrs.frozen
class Limits:
    """What admission enforces, known once the model is loaded."""

    project_bytes: Callable[[Generate], int]  # worst-case KV bytes of a request at its last token
    # Peak extra bytes while the request prefills. Prefill runs one request at a
    # time, so only the largest of these is ever live: it is counted once.
    transient_bytes: Callable[[Generate], int]
    budget_bytes: int
    max_rows: int  # 1 for a model whose caches cannot batch
    # --kv-layout paged: pin the cached blocks a request's prompt starts with, in one lease job that keeps the pin only
    # if the request fits with it (`fits(blocks)`, evaluated there: no step runs between the two), else None; and
    # the bytes of one block. A pinned block is counted once however many requests credit it, not in each.
    pin_prefix: Callable[[Generate, Callable[[frozenset[int]], bool]], Awaitable[Any]] | None = None
    block_bytes: int = 0


GetLimits = Callable[[], Awaitable[Limits]]


class KvBudgetExceeded(RequestError):
    """The request's worst-case KV cache cannot fit the budget even with nothing else running."""


@attrs.frozen
class AdmissionStatistics:
    mailbox_depth: int
    in_flight_rows: int
    max_rows: int
    reserved_bytes: int
    budget_bytes: int
    submitted: int
    admitted: int


class AdmissionActor:
    """Owns the pending queue and the KV budget; hands admitted requests to the prefill actor."""

    def __init__(self, lane: Lane, prefill: trio.MemorySendChannel[Generate], get_limits: GetLimits) -> None:
        # `prefill`: the prefill actor's inbox. The projection and the budget depend on the
        # model's KV layout, so they arrive (from `get_limits`) once the model is loaded.
        self._lane = lane
        self._prefill = prefill
        self._get_limits = get_limits
        self._faults = lane.faults
        self._project: Callable[[Generate], int] | None = None
        self._transient: Callable[[Generate], int] = lambda cmd: 0
        self._pin_prefix: Callable[[Generate, Callable[[frozenset[int]], bool]], Awaitable[Any]] | None = None
        self._block_bytes = 0
        self._budget = 0
        self._max_rows = lane.row_cap  # until the limits arrive (the model loads)
        self._max_queue = lane.config.max_queue
        # Invariant: _pending holds every submitted, not yet admitted request, in arrival order.
        self._pending: collections.deque[Generate] = collections.deque()
        # KV bytes of each row in flight, and its prefill transient (only the largest counts).
        self._reserved: dict[str, int] = {}
        self._transients: dict[str, int] = {}
        # --kv-layout paged: the pinned cached blocks each row in flight was credited (its `_reserved` excludes them).
        self._shared: dict[str, frozenset[int]] = {}
        self._wake = trio.Event()
        self._closed = False
        self._submitted = self._admitted = 0

    def submit_nowait(self, cmd: Generate) -> None:
        """Queue a request; `Overloaded` when the queue is full, `KvBudgetExceeded` when it can never fit."""
        self._lane.arrivals.reached(cmd.request_id)  # taken or refused: no longer on its way (actors/arrivals.py)
        if self._closed:
            raise LeaseClosed("admission is stopping")
        if self._project is not None:
            # Until the limits are known (a restart's first moments) the admit loop checks instead.
            self._check_fits_alone(cmd)
        if len(self._pending) >= self._max_queue:
            raise Overloaded(f"{len(self._pending)} requests are already waiting; retry shortly", retry_after_s=1.0)
        self._pending.append(cmd)
        self._submitted += 1
        self._wake.set()

    def queued(self) -> list[Generate]:
        """The requests submitted and not admitted yet, in arrival order."""
        return list(self._pending)

    def _check_fits_alone(self, cmd: Generate) -> None:
        assert self._project is not None
        need = self._project(cmd) + self._transient(cmd)
        if need > self._budget:
            raise KvBudgetExceeded(
                f"this request needs up to {need / 2**20:.1f} MiB of KV cache (prompt {len(cmd.prompt_ids)} tokens "
                f"+ max_tokens {cmd.params.max_tokens}) but the KV budget is {self._budget / 2**20:.1f} MiB; "
                "lower max_tokens, shorten the prompt, or raise --kv-budget"
            )

    def release(self, request_id: str) -> None:
        """A row is gone (finished, cancelled or failed): give its bytes and slot back."""
        if self._reserved.pop(request_id, None) is not None:
            self._transients.pop(request_id, None)
            self._shared.pop(request_id, None)
            self._wake.set()

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            mailbox_depth=len(self._pending), in_flight_rows=len(self._reserved), max_rows=self._max_rows,
            reserved_bytes=self._reserved_bytes(), budget_bytes=self.budget_now,
            submitted=self._submitted, admitted=self._admitted,
        )

    async def run(self, *, task_status: trio.TaskStatus[AdmissionActor] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        try:
            limits = await self._get_limits()
            self._project, self._budget, self._max_rows = limits.project_bytes, limits.budget_bytes, limits.max_rows
            self._transient = limits.transient_bytes
            self._pin_prefix, self._block_bytes = limits.pin_prefix, limits.block_bytes
            if self._pin_prefix is not None:
                await self._lane.drop_stale_pins()  # the pins of requests a crash ended (actors/lane.py)
            # A restarted admission inherits the rows still prefilling or decoding, so it never over-admits.
            for cmd in self._lane.in_flight():
                self._reserve(cmd)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._follow_memory)
                while True:
                    await self._admit_head()
        finally:
            self._closed = True
            for cmd in self._pending:
                self._lane.end_request(cmd)  # no last word: its session resumes
            self._pending.clear()

    async def _admit_head(self) -> None:
        while True:
            self._wake = trio.Event()  # before the pin's await: a wake during it is not lost
            await self._pin_head()
            if self._head_fits():
                break
            if self._pending:  # a waiting head holds no pin: its blocks stay evictable for the rows admitted
                pin = self._lane.pins.pop(self._pending[0].request_id, None)
                if pin is not None:
                    self._lane.unpin(pin)
            await self._wake.wait()
        self._faults.check("admission")
        cmd = self._pending[0]
        if cmd.reply.statistics().open_receive_channels == 0:
            # The session already left while queued: drop it, reserve nothing.
            self._pending.popleft()
            self._lane.end_request(cmd)
            return
        self._reserve(cmd)
        try:
            # Bounded by max_rows: admission never has more than that many rows in flight.
            await self._prefill.send(cmd)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            # Prefill died: our supervisor restarts us right after it (rest_for_one). Keep the
            # request queued so stopping closes its reply and its session resumes; don't crash twice.
            self.release(cmd.request_id)
            await trio.sleep_forever()
        except BaseException:
            self.release(cmd.request_id)
            raise
        self._pending.popleft()
        self._admitted += 1

    async def _pin_head(self) -> None:
        """--kv-layout paged: pin the head's cached prefix (on each try: blocks cached since count too), so its credit
        holds until its row takes the blocks over at join or `Lane.end_request` drops the pin.

        The pin is kept only if the head fits with it, judged in the pin's own lease job against the reservations
        as they stand (they only shrink meanwhile): pinned blocks are never evictable room a row admitted before
        counted on, so no step runs out of blocks (PoolExhausted)."""
        if self._pin_prefix is None or self._project is None or not self._pending:
            return
        if len(self._reserved) >= self._max_rows:
            return
        head = self._pending[0]
        persistence = self._lane.persistence
        revision = self._lane.kv_revision(head.adapter)
        if isinstance(persistence, BlockPersistenceActor) and revision is not None:
            # Stored blocks the pool lacks come back as cached blocks first (evictable, as the pool's count of
            # free-or-evictable blocks assumes), so the pin below credits them as any cached block.
            await persistence.restore_blocks(head.prompt_ids, revision)
            if not self._pending or self._pending[0] is not head:
                return  # dropped meanwhile: the next try pins the new head
        old = self._lane.pins.pop(head.request_id, None)
        if old is not None:
            self._lane.unpin(old)
        project, block = self._project(head), self._block_bytes
        held = frozenset[int]().union(*self._shared.values())
        room = (self.budget_now - sum(self._reserved.values())
                - max([self._transient(head), *self._transients.values()]))

        def fits(credit: frozenset[int]) -> bool:  # on the lease thread: reads only these snapshots
            return project - len(credit) * block + len(held | credit) * block <= room

        pin = await self._pin_prefix(head, fits)
        if pin is not None:
            self._lane.pins[head.request_id] = pin

    def _credit(self, cmd: Generate) -> frozenset[int]:
        """The cached blocks `cmd`'s pin holds: referenced by its row, never allocated (counted once for all)."""
        pin = self._lane.pins.get(cmd.request_id)
        return frozenset(pin.blocks) if pin is not None else frozenset()

    def _own_bytes(self, cmd: Generate, credit: frozenset[int]) -> int:
        """What `cmd`'s row may allocate: its projection less the pinned prefix it references."""
        assert self._project is not None
        return self._project(cmd) - len(credit) * self._block_bytes

    def _shared_bytes(self, *more: frozenset[int]) -> int:
        return len(frozenset().union(*self._shared.values(), *more)) * self._block_bytes

    def _head_fits(self) -> bool:
        if not self._pending or self._project is None:
            return False
        try:
            self._check_fits_alone(self._pending[0])
        except KvBudgetExceeded as exc:
            # Queued before the limits were known and can never fit: refuse it now.
            cmd = self._pending.popleft()
            self._lane.end_request(cmd, GenerationEnded(cmd.request_id, FinishReason.ERROR, exc))
            return self._head_fits()
        if len(self._reserved) >= self._max_rows:
            return False
        head = self._pending[0]
        peak_transient = max([self._transient(head), *self._transients.values()])
        credit = self._credit(head)
        need = (sum(self._reserved.values()) + self._own_bytes(head, credit) + self._shared_bytes(credit)
                + peak_transient)
        budget = self.budget_now
        if need > budget:
            if not self._reserved:
                # Nothing runs and the device is short of memory now (actors/memory_budget.py): waiting would
                # hold the request for as long as another process holds the memory.
                cmd = self._pending.popleft()
                self._lane.end_request(cmd, GenerationEnded(cmd.request_id, FinishReason.ERROR, Overloaded(
                    f"the device is short of memory: the KV budget is {budget / 2**20:.1f} MiB now "
                    f"(of {self._budget / 2**20:.1f} MiB) and this request needs up to {need / 2**20:.1f} MiB; "
                    "retry shortly", retry_after_s=MEMORY_RETRY_AFTER_S)))
                return self._head_fits()
            return False
        caching = self._lane.caching
        if caching is not None and need + caching.nbytes > budget:
            # One ceiling for live rows and the prompt cache: the cache gives way, never a row.
            caching.make_room(budget - need)
        return True

    @property
    def budget_now(self) -> int:
        """The bytes admission may reserve now: the budget as memory allows it (`Lane.memory`), else the whole."""
        memory = self._lane.memory
        return min(memory.current, self._budget) if memory is not None else self._budget

    async def _follow_memory(self) -> None:
        """About once a second: re-read the device's free memory, lift an out-of-memory cap that has held
        long enough, and let the queue and the prompt cache see the budget that results (actors/memory_budget.py)."""
        lease, memory = self._lane.lease, self._lane.memory
        if lease is None or memory is None:
            return
        follows = True
        while True:
            before = memory.current
            if follows:
                reading = await lease.run(device_memory_reading)
                follows = reading is not None  # a backend that reports no free memory never will
                if reading is not None:
                    memory.follow(*reading)
            memory.relax()
            if memory.current != before:
                log.warning("KV budget now %.1f MiB (was %.1f MiB): %s", memory.current / 2**20, before / 2**20,
                            memory.report()["reason"] or "memory is free again")
                caching = self._lane.caching
                if caching is not None:
                    caching.make_room(max(memory.current - self._reserved_bytes(), 0))
                self._wake.set()
            await trio.sleep(MEMORY_FOLLOW_S)

    def _reserve(self, cmd: Generate) -> int:
        assert self._project is not None
        credit = self._credit(cmd)
        self._reserved[cmd.request_id] = need = self._own_bytes(cmd, credit)
        self._shared[cmd.request_id] = credit
        self._transients[cmd.request_id] = self._transient(cmd)
        return need

    def unreserved_bytes(self) -> int:
        """Budget bytes no row holds: what the prompt cache may fill (once the limits are known)."""
        return max(self.budget_now - self._reserved_bytes(), 0) if self._project is not None else 0

    def _reserved_bytes(self) -> int:
        return sum(self._reserved.values()) + self._shared_bytes() + max(self._transients.values(), default=0)
