"""The KV budget as the device's memory allows it now (docs/design.md §6.6).

The budget computed at start is a ceiling, not a promise: another process
(a second server, a notebook, on a Mac every other application) may take
memory after we started. A budget that never moves then admits rows the
device cannot hold, every decode step runs out of memory, and the restarted
decoder admits the same rows again: a crash loop (H200, 2026-12-04: 67
crashes in two minutes, 194 of 200 requests failed). So the budget in force
is the least of

- the configured one (`--kv-budget`, or what was free at start);
- the configured one less what *other* processes took since the first
  reading, where the backend reports free memory (`follow`, re-read about
  once a second). Our own process's memory (KV, activations, MLX's cache of
  freed buffers) never counts against it: "free memory plus the KV we hold"
  cannot tell our own prefill transients or padding from another process;
- after an out-of-memory error, a cap below the KV held when it struck
  (`shrink`), lifted step by step while none strikes again (`relax`);

and never less than a floor (a sixteenth of the configured budget), so a
lane always admits something when it is idle. The rows in flight when memory
ran out end without a last word and resume (their sessions re-submit them,
the one resume loop); admission then fits fewer. This record outlives actor
restarts (it lives on the `Lane`); the admission actor reads it at every
decision. Pure Python, no MLX: the free memory is read on the lease thread by
the caller (engine/kv/layout.py `free_memory_bytes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

# An out-of-memory error, as MLX raises it on each backend (a RuntimeError) or Python does (MemoryError):
# "[malloc] Unable to allocate N bytes", CUDA's "out of memory" / cudaErrorMemoryAllocation, Metal's
# "Insufficient Memory" (kIOGPUCommandBufferCallbackErrorOutOfMemory).
OOM_MARKERS = ("unable to allocate", "out of memory", "outofmemory", "insufficient memory", "memoryallocation")
# After an out-of-memory error the budget is at most this share of the KV held when it struck.
SHRINK = 0.75
# The budget never drops below this share of the configured one.
FLOOR_FRACTION = 1 / 16
# With no out-of-memory error for this long, the cap it left rises by `RELAX_STEP` (of the configured budget).
RELAX_AFTER_S = 10.0
RELAX_STEP = 1 / 8


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is the device (or host) running out of memory."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc).lower() for marker in OOM_MARKERS)


@attrs.define
class MemoryBudget:
    """The KV budget in force: `current` bytes, at most `configured`; see the module docstring."""

    configured: int
    clock: Callable[[], float] = time.monotonic
    _free_cap: int | None = attrs.field(default=None, init=False)
    _oom_cap: int | None = attrs.field(default=None, init=False)
    _oom_at: float = attrs.field(default=0.0, init=False)
    out_of_memory_errors: int = attrs.field(default=0, init=False)
    free_bytes: int | None = attrs.field(default=None, init=False)  # the device's free memory at the last read
    # Device memory not held by other processes (free + ours) at the first reading, and what they took since.
    _baseline: int | None = attrs.field(default=None, init=False)
    taken_by_others: int = attrs.field(default=0, init=False)

    @property
    def floor(self) -> int:
        return int(self.configured * FLOOR_FRACTION)

    @property
    def current(self) -> int:
        """The bytes admission may reserve now."""
        caps = [self.configured, *(cap for cap in (self._free_cap, self._oom_cap) if cap is not None)]
        return max(min(caps), self.floor)

    @property
    def degraded(self) -> bool:
        return self.current < self.configured

    def follow(self, free: int | None, ours: int = 0) -> None:
        """The device reports `free` bytes while this process's MLX holds `ours` (active + cached buffers): the
        budget shrinks by what other processes took since the first reading (None: this backend reports no free
        memory; the budget follows errors alone). The configured budget was set with the memory free at start,
        so only others' growth since then can make it too large."""
        self.free_bytes = free
        if free is None:
            self._free_cap = None
            return
        available = free + ours
        if self._baseline is None:
            self._baseline = available
        self.taken_by_others = max(self._baseline - available, 0)
        self._free_cap = max(self.configured - self.taken_by_others, 0)

    def shrink(self, held: int) -> None:
        """Memory ran out while `held` bytes of KV were in use: cap the budget below that."""
        self.out_of_memory_errors += 1
        cap = int(min(held, self.current) * SHRINK)
        self._oom_cap = cap if self._oom_cap is None else min(self._oom_cap, cap)
        self._oom_at = self.clock()

    def relax(self) -> bool:
        """Lift the out-of-memory cap a step if none struck for `RELAX_AFTER_S`; True if the budget rose."""
        if self._oom_cap is None or self.clock() - self._oom_at < RELAX_AFTER_S:
            return False
        before = self.current
        self._oom_cap += max(int(self.configured * RELAX_STEP), 1)
        self._oom_at = self.clock()
        if self._oom_cap >= self.configured:
            self._oom_cap = None
        return self.current > before

    def report(self) -> dict[str, object]:
        """For `/v1/status` and `/health`: the numbers, and why the budget is low (empty reason when it is not)."""
        reason = ""
        if self.degraded:
            why = []
            if self._free_cap is not None and self._free_cap < self.configured:
                why.append(f"other processes took {_gib(self.taken_by_others)} since start; "
                           f"the device has {_gib(self.free_bytes or 0)} free")
            if self._oom_cap is not None:
                why.append(f"{self.out_of_memory_errors} out-of-memory error(s)")
            reason = (f"degraded: memory: KV budget {_gib(self.current)} of {_gib(self.configured)} configured "
                      f"({'; '.join(why) or 'floor'}); fewer rows are admitted until memory is free again")
        return {"configured_bytes": self.configured, "current_bytes": self.current, "free_bytes": self.free_bytes,
                "taken_by_others_bytes": self.taken_by_others,
                "out_of_memory_errors": self.out_of_memory_errors, "degraded": self.degraded, "reason": reason}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
