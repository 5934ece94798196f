"""`Splice`: one streamed answer's bytes from rank 0, cut into what its client may see, over every attempt.

Rank 0 ends each body chunk with a commit comment (`protocol.commit`): the front forwards a chunk only
once its commit arrived, so what the client holds always ends at a commit, and the token ids of the
commits so far (`groups`, one entry per chunk that covered tokens) are exactly what it saw. A cut
(rank 0 died mid-chunk, or sent `: lost`) drops the uncommitted rest; the next attempt, on the next
generation, replays `groups` and sends only what follows (`protocol.py`). Comments of our own never
reach the client.
"""

from __future__ import annotations

from mlx_trio.front.protocol import COMMIT, LOST


class Splice:
    """`feed` each piece of an attempt's body; `end` at its clean end; `restart` before the next attempt."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []  # the token ids of each committed chunk that covered any
        self.opened = False  # a commit arrived: the client has the answer's opening
        self.lost = False  # this attempt ended with rank 0's `: lost`
        self._buffer = b""  # an event not yet whole
        self._pending: list[bytes] = []  # whole events not yet committed

    @property
    def delivered(self) -> int:
        return sum(len(g) for g in self.groups)

    def feed(self, data: bytes) -> bytes:
        """The bytes the client may have now (whole committed events, our comments stripped)."""
        if self.lost:
            return b""
        self._buffer += data
        out: list[bytes] = []
        start = 0
        while (end := self._buffer.find(b"\n\n", start)) >= 0:
            event, start = self._buffer[start:end + 2], end + 2
            if event.startswith(COMMIT):
                ids = [int(t) for t in event[len(COMMIT):].split()]
                if ids:
                    self.groups.append(ids)
                self.opened = True
                out.extend(self._pending)
                self._pending = []
            elif event == LOST:
                self.lost = True
                self._pending, start = [], len(self._buffer)
                break
            else:
                self._pending.append(event)
        self._buffer = self._buffer[start:]
        return b"".join(out)

    def end(self) -> bytes:
        """The attempt's body ended cleanly (its last chunk carries no commit: the end is its commit)."""
        rest = b"".join(self._pending) + self._buffer
        self._pending, self._buffer = [], b""
        return rest

    def restart(self) -> None:
        """Before the next attempt: drop what the cut one left uncommitted."""
        self.lost, self._buffer, self._pending = False, b"", []
