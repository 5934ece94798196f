"""Start-up progress and readiness: /health names the phase running, each phase is logged as it starts,
and readiness waits for no warm-up (issue #46): the batch lane's kernels compile in a lease job after it."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import trio

import mlx_trio.actors.engine_tree
from mlx_trio import open_engine
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

PROMPT = [3 + (7 * i) % 500 for i in range(40)]
WAIT_S = 30.0  # only reached when a test fails


async def test_readiness_does_not_wait_for_the_batch_lane_warm_up_and_every_phase_is_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tiny_model(LLAMA))
    async with open_engine(path) as plain:
        expected = (await plain.complete(PROMPT, max_tokens=6)).token_ids
    release, entered, done = threading.Event(), threading.Event(), threading.Event()
    warm_up_gpu = mlx_trio.actors.engine_tree.warm_up_gpu

    def held_warm_up(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(WAIT_S)  # on the lease thread: holds the warm-up only (it does nothing on the CPU)
        try:
            return warm_up_gpu(*args, **kwargs)
        finally:
            done.set()

    monkeypatch.setattr(mlx_trio.actors.engine_tree, "warm_up_gpu", held_warm_up)
    caplog.set_level(logging.INFO, logger="mlx_trio.engine")
    async with open_engine(path) as engine:  # returns once ready
        assert not done.is_set()  # ready before the warm-up ended (it ran before readiness: failed here)
        with trio.fail_after(WAIT_S):
            while not entered.is_set():
                await trio.sleep(0.01)
        assert engine.actors.health() == (True, "ok")  # while the warm-up holds the lease
        answered: list[list[int]] = []

        async def ask() -> None:
            answered.append((await engine.complete(PROMPT, max_tokens=6)).token_ids)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.sleep(0.2)
            assert not answered  # the request waits for the one warm-up job ...
            release.set()
        assert answered == [expected]  # ... then is answered, tokens unchanged
    phases = [r.getMessage().split(" (")[0] for r in caplog.records if r.getMessage().startswith("start-up: ")]
    assert phases == [f"start-up: reading the weights of {path}", "start-up: done; serving once every actor runs"]
