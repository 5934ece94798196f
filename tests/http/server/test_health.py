"""/health tells the truth about the real engine: 503 while loading and after the tree stopped."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
import trio
from tests.http.fakes import FakeEngine
from tests.http.http_helpers import CLIENT_TIMEOUT_S, serve_fake, tiny_engine_config

import mlx_trio.actors.engine_tree
from mlx_trio.api import Engine
from mlx_trio.http import HttpServer, ServerConfig


async def test_health_is_503_until_the_model_has_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the model load held back, /health is 503 "loading model: <phase>" and completions are 503; then 200."""
    release = threading.Event()
    load_model = mlx_trio.actors.engine_tree.load_model

    def held_load(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)  # runs on the lease thread: blocks only the load
        return load_model(*args, **kwargs)

    monkeypatch.setattr(mlx_trio.actors.engine_tree, "load_model", held_load)
    server = HttpServer(ServerConfig(port=0))
    engine = Engine(tiny_engine_config(), extra_children=[server.child_spec])
    server.attach(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            response = await client.get("/health")
            assert response.status_code == 503
            # The phase is named (actors/engine_tree.py `_phase`): here the weights being read.
            assert response.json() == {"status": "unavailable",
                                       "reason": f"loading model: reading the weights of {engine.config.model}"}
            assert (await client.get("/v1/models")).json()["data"][0]["id"]
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 503
            release.set()
            with trio.fail_after(30):
                await engine.wait_ready()
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        nursery.cancel_scope.cancel()


async def test_after_the_engine_tree_stopped_health_and_completions_are_503() -> None:
    """A server outliving its engine's tree: /health 503 naming the actors down, completions 503 (not 500)."""
    engine = Engine(tiny_engine_config())
    server = HttpServer(ServerConfig(port=0), engine)
    async with trio.open_nursery() as outer:
        await outer.start(server.run)
        async with trio.open_nursery() as engine_nursery:
            await engine_nursery.start(engine.run)
            with trio.fail_after(30):
                await engine.wait_ready()
            async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
                assert (await client.get("/health")).status_code == 200
            engine_nursery.cancel_scope.cancel()
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            health = await client.get("/health")
            completion = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        outer.cancel_scope.cancel()
    assert health.status_code == 503
    assert health.json()["status"] == "unavailable" and "not running" in health.json()["reason"]
    assert completion.status_code == 503, completion.text
    assert completion.json()["error"]["code"] == "engine_unavailable"


async def test_draining_server_reports_503() -> None:
    """Once a graceful shutdown starts, /health is 503 "draining" and new completions are refused."""
    engine = Engine(tiny_engine_config())
    server = HttpServer(ServerConfig(port=0), engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        server.state.draining = True
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            response = await client.get("/health")
            refused = await client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503 and response.json()["status"] == "draining"
        assert "draining" in response.json()["reason"]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        nursery.cancel_scope.cancel()
    assert server.port is None


class _DiskStalledEngine(FakeEngine):
    """A healthy fake whose SSD tier was turned off by a hung disk."""

    def status(self) -> dict[str, Any]:
        reason = "disk stalled: a read in /cache took over 10 s"
        return {**super().status(), "prompt_cache": {"ssd": {"enabled": True, "degraded": True, "reason": reason}}}


async def test_health_stays_200_and_names_a_degraded_ssd_tier() -> None:
    """Requests run on without the SSD tier, so /health is 200; its details say what is off and why."""
    async with serve_fake(_DiskStalledEngine()) as (_, client):
        response = await client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok",
                               "details": {"prompt_cache_ssd": "disk stalled: a read in /cache took over 10 s"}}
    async with serve_fake(FakeEngine()) as (_, client):
        assert (await client.get("/health")).json() == {"status": "ok"}


class _ShortOfMemoryEngine(FakeEngine):
    """A healthy fake whose KV budget memory pressure shrank (actors/memory_budget.py `report`)."""

    def status(self) -> dict[str, Any]:
        reason = ("degraded: memory: KV budget 2.00 GiB of 8.00 GiB configured (the device has 2.50 GiB free); "
                  "fewer rows are admitted until memory is free again")
        return {**super().status(), "memory": {"degraded": True, "reason": reason, "current_bytes": 2 << 30,
                                               "configured_bytes": 8 << 30, "free_bytes": 5 << 29}}


async def test_health_stays_200_and_says_degraded_memory_with_the_numbers() -> None:
    async with serve_fake(_ShortOfMemoryEngine()) as (_, client):
        response = await client.get("/health")
    assert response.status_code == 200
    assert response.json()["details"]["memory"].startswith("degraded: memory: KV budget 2.00 GiB of 8.00 GiB")
