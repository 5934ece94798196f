"""`GroupState`: what the launcher thread tells the front about the ranks (thread-safe; no Trio, no MLX)."""

from __future__ import annotations

import threading

import attrs


@attrs.frozen
class Generation:
    """One launch of the ranks: its number, rank 0's loopback port, and why it is not serving (if known)."""

    number: int
    port: int | None
    reason: str


class GroupState:
    """Written by mlx_trio/local_group.py's loop, read by the front; every method takes the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = Generation(0, None, "starting: the ranks are being launched")

    def launched(self, number: int, port: int, reason: str) -> None:
        """Generation `number` starts; rank 0 will serve on `port` once it loaded its shard."""
        with self._lock:
            self._now = Generation(number, port, reason)

    def lost(self, reason: str) -> None:
        """The current generation is lost (`reason`); the front sends it nothing more."""
        with self._lock:
            self._now = Generation(self._now.number, None, reason)

    def now(self) -> Generation:
        with self._lock:
            return self._now
