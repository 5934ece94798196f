"""Start-up progress: /health's reason names the phase running, and each phase is logged as it starts."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import trio

import mlx_trio.actors.engine_tree
from mlx_trio.api import Engine
from mlx_trio.config import EngineConfig
from mlx_trio.testing.tiny_models import LLAMA, tiny_model


async def test_the_warm_up_phase_is_named_in_health_and_every_phase_is_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    warm_up_gpu = mlx_trio.actors.engine_tree.warm_up_gpu

    def held_warm_up(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)  # on the lease thread: holds the warm-up only
        return warm_up_gpu(*args, **kwargs)

    monkeypatch.setattr(mlx_trio.actors.engine_tree, "warm_up_gpu", held_warm_up)
    path = str(tiny_model(LLAMA))
    engine = Engine(EngineConfig(model=path))
    caplog.set_level(logging.INFO, logger="mlx_trio.engine")
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(30):
            while engine.health()[1] != "loading model: warming up the batch lane (compiling its kernels)":
                await trio.sleep(0.01)
        assert engine.health()[0] is False
        release.set()
        with trio.fail_after(30):
            await engine.wait_ready()
        assert engine.health() == (True, "ok")
        nursery.cancel_scope.cancel()
    phases = [r.getMessage().split(" (")[0] for r in caplog.records if r.getMessage().startswith("start-up: ")]
    assert phases == [f"start-up: reading the weights of {path}", "start-up: warming up the batch lane",
                      "start-up: done; serving once every actor runs"]
