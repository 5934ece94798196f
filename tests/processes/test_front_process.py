"""A front process's start: reading the engine's output format (its unpickle imports mlx-lm, seconds on a small
CPU) once the model is known must not hold the front's event loop, so /health answers 200 as soon as the engine
is ready (issue #46)."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import trio

from mlx_trio.processes import front_process

WAIT_S = 3.0  # only reached when the test fails


class _SlowFormatEngine:
    """Stands in for RemoteEngine: the model is known, and reading its output format blocks until released."""

    def __init__(self) -> None:
        self.model_known = trio.Event()
        self.release, self.reading = threading.Event(), threading.Event()
        self.released: bool | None = None  # whether the read ended on release (False: it timed out)

    @property
    def output_format(self) -> Any:
        self.reading.set()
        self.released = self.release.wait(WAIT_S)
        return object()


async def test_the_output_format_is_read_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    engine = _SlowFormatEngine()
    engine.model_known.set()
    ticks = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front_process._freeze_when_known, engine)
        with trio.fail_after(WAIT_S):
            while not engine.reading.is_set():
                await trio.sleep(0.001)
        for _ in range(5):  # the loop runs (a /health would be answered) while the format is being read
            await trio.sleep(0.001)
            ticks += 1
        engine.release.set()
    assert ticks == 5 and engine.released  # before: the loop was held until the read timed out
    assert frozen == [True]  # then the front freezes, as before
