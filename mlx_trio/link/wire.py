"""Frames of the engine link: each frame is a length and one pickled list of messages.

A message is `(op, id, payload)`: `op` a short string, `id` the call's or
stream's number on this link (0 for pushed facts), `payload` any picklable
value (engine events and requests are frozen attrs; errors are `MlxTrioError`,
which pickle whatever their `__init__`). Pickle, not JSON: both ends are our
own processes on one machine, the socket is private to them (a 0700 directory),
and events cross without a schema of their own.

`Outbox` is the one writer of a link end: whoever has something to say puts it
in its channel, and the writer sends everything queued at once as one frame,
so the tokens of one decode step for many requests cost one write, not one
each.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import trio

Message = tuple[str, int, Any]

_LENGTH = struct.Struct("!I")
# Bounds a frame (a runaway or foreign peer must not make us allocate gigabytes).
MAX_FRAME_BYTES = 256 * 1024 * 1024
# Messages an outbox holds before its senders wait (backpressure on the producers, not unbounded memory).
OUTBOX_MESSAGES = 65536


class LinkClosed(Exception):
    """The other end of the link went away (EOF, reset, or a frame that cannot be read)."""


class FrameReader:
    """Reads whole frames from a stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def receive(self) -> list[Message]:
        """The next frame's messages; raises `LinkClosed` at EOF or on a broken stream."""
        length = _LENGTH.unpack(await self._exactly(_LENGTH.size))[0]
        if length > MAX_FRAME_BYTES:
            raise LinkClosed(f"a frame of {length} bytes is over the link's {MAX_FRAME_BYTES}")
        try:
            return pickle.loads(await self._exactly(length))
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            raise LinkClosed(f"an unreadable frame: {exc!r}") from exc

    async def _exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            try:
                data = await self._stream.receive_some(max(65536, n - len(self._buffer)))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise LinkClosed(repr(exc)) from exc
            if not data:
                raise LinkClosed("end of stream")
            self._buffer += data
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out


def frame(messages: list[Message]) -> bytes:
    body = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class Outbox:
    """A link end's single writer: `put` from any task, `run` sends what is queued as one frame."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[Message](OUTBOX_MESSAGES)

    async def put(self, message: Message) -> None:
        await self._send.send(message)

    def put_nowait(self, message: Message) -> None:
        """For sync callers (a cancel on the way out of a stream); raises `trio.WouldBlock` when full."""
        self._send.send_nowait(message)

    async def run(self, stream: trio.abc.SendStream) -> None:
        """Send frames until cancelled; raises `LinkClosed` when the stream breaks."""
        async for first in self._receive:
            # One pass of the scheduler first: the other streams woken by the same decode step
            # put their tokens in too, and go out in this frame.
            await trio.lowlevel.checkpoint()
            batch = [first]
            while True:
                try:
                    batch.append(self._receive.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                await stream.send_all(frame(batch))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise LinkClosed(repr(exc)) from exc


async def until_closed(*tasks: Callable[[], Awaitable[object]]) -> LinkClosed:
    """Run `tasks` together until one of them finds the link closed; that `LinkClosed`, the others cancelled.

    Returned, not raised, so the caller handles the end of its link without unwrapping an exception group.
    """
    closed: list[LinkClosed] = []
    async with trio.open_nursery() as nursery:
        async def guarded(task: Callable[[], Awaitable[object]]) -> None:
            try:
                await task()
            except LinkClosed as exc:
                closed.append(exc)
                nursery.cancel_scope.cancel()

        for task in tasks:
            nursery.start_soon(guarded, task)
    return closed[0] if closed else LinkClosed("the link's tasks ended")
