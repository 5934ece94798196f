"""Fault injection: make an actor fail on purpose, for tests and for ops drills.

An engine owns one `Faults` registry. Actors call `faults.check(actor_id)`
at each message or step; an armed fault for that id fires there, once. Ids
are the ones `/v1/status` shows (`decode-step`, `prefill`, `admission`,
`gpu-lease`, `cache-persistence`, `http`, `session-req-7`); the id `session` matches any session.
`GET/POST /v1/admin/faults` (only with `--enable-fault-injection`) arms them.
"""

from __future__ import annotations

import enum

import attrs


class FaultKind(enum.Enum):
    RAISE = "raise"  # raise InjectedFault inside the actor (or inside a lease job for gpu-lease)
    HANG = "hang"  # a lease job that never finishes, until the watchdog gives up on it (cache-persistence: its next write)
    FAIL_WRITE = "fail-write"  # the next SSD write of the cache-persistence actor fails
    STALL_IO = "stall-io"  # the next SSD file operation of cache-persistence blocks (a hung disk) past its timeout
    KILL_LISTENER = "kill-listener"  # the HTTP server itself dies at its next request: every connection is cut
    OUT_OF_MEMORY = "out-of-memory"  # raise what MLX raises when the device's memory runs out (decode-step, prefill)


# Where a kind can fire, when not everywhere: arming it anywhere else would be accepted and never fire.
FIRES_ONLY_AT: dict[FaultKind, frozenset[str]] = {
    FaultKind.HANG: frozenset({"gpu-lease", "cache-persistence"}),
    FaultKind.FAIL_WRITE: frozenset({"cache-persistence"}),
    FaultKind.STALL_IO: frozenset({"cache-persistence"}),
    FaultKind.KILL_LISTENER: frozenset({"http"}),
    FaultKind.OUT_OF_MEMORY: frozenset({"decode-step", "prefill"}),
}


class InjectedFault(RuntimeError):
    """Raised by an armed fault. A RuntimeError, so it crashes an actor like any bug would."""


class InjectedOutOfMemory(RuntimeError):
    """Raised by an armed out-of-memory fault: MLX's own words for a failed allocation (actors/memory_budget.py)."""


@attrs.frozen
class ArmedFault:
    actor: str
    kind: FaultKind


class Faults:
    """Armed one-shot faults, keyed by actor id. Plain data, Trio-thread only."""

    def __init__(self) -> None:
        self._armed: list[ArmedFault] = []
        self._fired: list[ArmedFault] = []

    def arm(self, actor: str, kind: FaultKind | str) -> ArmedFault:
        """Arm a one-shot fault; `ValueError` for a kind that can never fire at `actor` (see `FIRES_ONLY_AT`)."""
        fault = ArmedFault(actor, FaultKind(kind))
        where = FIRES_ONLY_AT.get(fault.kind)
        if where is not None and actor not in where:
            raise ValueError(f"a {fault.kind.value!r} fault fires only at {', '.join(sorted(where))}, not at {actor!r}")
        self._armed.append(fault)
        return fault

    def armed(self) -> list[ArmedFault]:
        return list(self._armed)

    @property
    def fired(self) -> list[ArmedFault]:
        """The faults that fired, oldest first."""
        return self._fired

    def take(self, actor: str, kind: FaultKind) -> bool:
        """Consume a fault of `kind` armed for `actor` (or for any session); True if there was one."""
        for fault in self._armed:
            if fault.kind is kind and _matches(fault.actor, actor):
                self._armed.remove(fault)
                self._fired.append(fault)
                return True
        return False

    def check(self, actor: str) -> None:
        """Raise `InjectedFault` if a RAISE fault is armed for `actor`, `InjectedOutOfMemory` for an OUT_OF_MEMORY one."""
        if self._armed and self.take(actor, FaultKind.RAISE):
            raise InjectedFault(f"fault injected into {actor}")
        if self._armed and self.take(actor, FaultKind.OUT_OF_MEMORY):
            raise InjectedOutOfMemory(f"[malloc] Unable to allocate 1073741824 bytes. (fault injected into {actor})")


def _matches(pattern: str, actor: str) -> bool:
    return pattern == actor or (pattern == "session" and actor.startswith("session-"))
