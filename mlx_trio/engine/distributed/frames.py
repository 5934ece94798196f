"""Bytes from rank 0 to every rank over the group's collectives (no transport of our own).

A message goes as one `all_sum` of a fixed-size frame (rank 0 writes, the others add zeros):
its first 4 bytes are the message length, the rest its first bytes; a longer message sends its
remainder in a second `all_sum`. Most jobs (decode steps, joins, frees) fit one frame, so a job
costs one collective. An `all_sum` is used rather than send/recv so the same code serves every
backend and any number of ranks. Runs on the lease thread (these are MLX ops).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

FRAME_BYTES = 1024
_HEADER = 4
STOP = b""  # an empty message: the followers leave their loop


def send(group: mx.distributed.Group, message: bytes) -> None:
    """Rank 0: deliver `message` to every rank (blocks until all have joined the collective)."""
    frame = np.zeros(FRAME_BYTES, dtype=np.uint8)
    frame[:_HEADER] = np.frombuffer(len(message).to_bytes(_HEADER, "little"), dtype=np.uint8)
    head = message[: FRAME_BYTES - _HEADER]
    frame[_HEADER:_HEADER + len(head)] = np.frombuffer(head, dtype=np.uint8)
    _sum(group, frame)
    rest = message[len(head):]
    if rest:
        _sum(group, np.frombuffer(rest, dtype=np.uint8))


def receive(group: mx.distributed.Group) -> bytes:
    """A follower: the next message rank 0 sends (blocks until it does)."""
    frame = _sum(group, np.zeros(FRAME_BYTES, dtype=np.uint8))
    length = int.from_bytes(frame[:_HEADER], "little")
    head = frame[_HEADER:_HEADER + min(length, FRAME_BYTES - _HEADER)]
    if length <= FRAME_BYTES - _HEADER:
        return head
    return head + _sum(group, np.zeros(length - len(head), dtype=np.uint8))


def _sum(group: mx.distributed.Group, data: np.ndarray) -> bytes:
    total = mx.distributed.all_sum(mx.array(data), group=group)
    mx.eval(total)
    return bytes(memoryview(total))
