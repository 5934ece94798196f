"""/v1/admin/faults (only with --enable-fault-injection) and the HTTP child's own fault point."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from tests.http.fakes import FakeEngine
from tests.http.http_helpers import CLIENT_TIMEOUT_S, assert_openai_error, serve_fake, served_engine
from prometheus_client.parser import text_string_to_metric_families

from mlx_trio.api import MAX_RESUMES
from mlx_trio.supervision.faults import FaultKind

KEY = {"Authorization": "Bearer sekret"}


class TreeEngine(FakeEngine):
    """A fake engine whose status tree has a supervisor, two actors and a session."""

    def status(self) -> dict[str, Any]:
        leaf = {"restart": "permanent", "state": "running", "restarts": 0}
        tree = {"id": "root", "kind": "supervisor", "children": [
            {"id": "engine", "kind": "supervisor", "children": [{"id": "decode-step", "kind": "decode-step", **leaf}]},
            {"id": "sessions", "kind": "supervisor", "children": [
                {"id": "session-req-1", "kind": "session", **leaf, "restart": "temporary"}]},
            {"id": "http", "kind": "http", **leaf},
        ]}
        return {**super().status(), "tree": tree}


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_admin_faults_are_404_without_the_flag(method: str) -> None:
    """Without --enable-fault-injection the admin routes do not exist: an OpenAI-shaped 404."""
    engine = TreeEngine()
    async with serve_fake(engine) as (_, client):
        response = await client.request(method, "/v1/admin/faults", json={"actor": "http", "kind": "raise"})
    assert_openai_error(response, 404, code="not_found")
    assert engine.faults.armed() == []


async def test_arming_a_fault_over_http_arms_it_in_the_engine() -> None:
    """POST arms the fault in engine.faults and echoes it; GET lists it as armed, then as fired."""
    engine = TreeEngine()
    async with serve_fake(engine, enable_fault_injection=True) as (_, client):
        response = await client.post("/v1/admin/faults", json={"actor": "decode-step", "kind": "raise"})
        assert response.status_code == 200, response.text
        assert response.json() == {"armed": {"actor": "decode-step", "kind": "raise"}}
        assert (await client.post("/v1/admin/faults", json={"actor": "session", "kind": "raise"})).status_code == 200
        listed = (await client.get("/v1/admin/faults")).json()
        assert listed == {"armed": [{"actor": "decode-step", "kind": "raise"}, {"actor": "session", "kind": "raise"}],
                          "fired": []}
        assert engine.faults.take("session-req-9", FaultKind.RAISE)
        listed = (await client.get("/v1/admin/faults")).json()
        assert listed["fired"] == [{"actor": "session", "kind": "raise"}]


class PersistenceTreeEngine(FakeEngine):
    """A fake engine whose status tree holds the batch lane's actors and the cache-persistence actor."""

    def status(self) -> dict[str, Any]:
        leaf = {"restart": "permanent", "state": "running", "restarts": 0}
        engine = {"id": "engine", "kind": "supervisor", "children": [
            {"id": actor, "kind": actor, **leaf}
            for actor in ("gpu-lease", "decode-step", "prefill", "admission", "cache-persistence")]}
        return {**super().status(), "tree": {"id": "root", "kind": "supervisor", "children": [engine]},
                "prompt_cache": {"ssd": self.ssd}}

    ssd: dict[str, Any] = {"enabled": True, "degraded": False, "reason": ""}  # noqa: RUF012 (read only)


@pytest.mark.parametrize(("ssd", "words"), [
    ({"enabled": False, "degraded": False, "reason": ""}, "off (no --prompt-cache-dir)"),
    ({"enabled": True, "degraded": True, "reason": "disk stalled: a read in /c took over 10 s"}, "disk stalled"),
])
@pytest.mark.parametrize("kind", ["raise", "hang", "fail-write", "stall-io"])
async def test_cache_persistence_faults_are_refused_without_an_ssd_tier(
        ssd: dict[str, Any], words: str, kind: str) -> None:
    """With no SSD tier (or one turned off) the actor reads and writes nothing: no fault there can fire."""
    engine = PersistenceTreeEngine()
    engine.ssd = ssd
    async with serve_fake(engine, enable_fault_injection=True) as (_, client):
        response = await client.post("/v1/admin/faults", json={"actor": "cache-persistence", "kind": kind})
    error = assert_openai_error(response, 400, code="invalid_value", param="actor")
    assert "would never fire" in error["message"] and words in error["message"]
    assert engine.faults.armed() == []


async def test_a_fail_write_fault_can_be_armed_for_the_cache_persistence_actor() -> None:
    """POST {"actor": "cache-persistence", "kind": "fail-write"} is 200 and arms FAIL_WRITE for that actor,
    which is what CachePersistenceActor takes before its next SSD write."""
    engine = PersistenceTreeEngine()
    async with serve_fake(engine, enable_fault_injection=True) as (_, client):
        response = await client.post("/v1/admin/faults", json={"actor": "cache-persistence", "kind": "fail-write"})
        assert response.status_code == 200, response.text
        assert response.json() == {"armed": {"actor": "cache-persistence", "kind": "fail-write"}}
        assert [(f.actor, f.kind) for f in engine.faults.armed()] == [("cache-persistence", FaultKind.FAIL_WRITE)]
        # Armed for that actor only, and of that kind only: a raise check does not consume it.
        engine.faults.check("cache-persistence")
        assert not engine.faults.take("decode-step", FaultKind.FAIL_WRITE)
        assert engine.faults.take("cache-persistence", FaultKind.FAIL_WRITE)
        assert (await client.get("/v1/admin/faults")).json() == {
            "armed": [], "fired": [{"actor": "cache-persistence", "kind": "fail-write"}]}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"actor": "http", "kind": "explode"}, "kind", ["'raise'", "'hang'", "'fail-write'", "'kill-listener'", "explode"]),
    ({"actor": "http"}, "kind", ["'raise'"]),
    ({"actor": 3, "kind": "raise"}, "actor", ["/v1/status"]),
    # The ids present are listed; supervisors (which check no faults) are not.
    ({"actor": "decoder", "kind": "raise"}, "actor",
     ["'decoder'", "decode-step", "http", "session (any session)", "session-req-1"]),
    ({"actor": "engine", "kind": "raise"}, "actor", ["'engine'", "decode-step"]),
    # A session that finished (or never was) has left the tree: its fault would never fire.
    ({"actor": "session-req-0", "kind": "raise"}, "actor", ["'session-req-0'", "session-req-1"]),
    ({"actor": "session-req-1", "kind": "stall-io"}, "kind", ["fires only at", "cache-persistence"]),
    # A kind that can never fire at that actor is refused, not accepted and silently never fired.
    ({"actor": "decode-step", "kind": "hang"}, "kind", ["fires only at", "gpu-lease", "'decode-step'"]),
    ({"actor": "decode-step", "kind": "kill-listener"}, "kind", ["fires only at http", "'decode-step'"]),
])
async def test_a_bad_fault_body_is_400_naming_the_field(body: dict[str, Any], param: str, words: list[str]) -> None:
    """An unknown kind or an actor id not in the status tree is a 400 naming the field; nothing is armed."""
    engine = TreeEngine()
    async with serve_fake(engine, enable_fault_injection=True) as (_, client):
        response = await client.post("/v1/admin/faults", json=body)
    error = assert_openai_error(response, 400, code="invalid_value", param=param)
    for word in words:
        assert word in error["message"]
    assert engine.faults.armed() == []


async def test_admin_faults_need_the_api_key() -> None:
    """With --api-key, arming and listing faults need the key like every endpoint but /health."""
    engine = TreeEngine()
    async with serve_fake(engine, enable_fault_injection=True, api_key="sekret") as (_, client):
        body = {"actor": "http", "kind": "raise"}
        assert_openai_error(await client.post("/v1/admin/faults", json=body), 401, code="invalid_api_key")
        assert_openai_error(await client.get("/v1/admin/faults"), 401, code="invalid_api_key")
        assert engine.faults.armed() == []
        assert (await client.get("/v1/admin/faults", headers=KEY)).status_code == 200


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


async def test_a_killed_listener_restarts_the_http_child_on_the_same_port() -> None:
    """A "kill-listener" fault kills the server task (the request gets no answer), not just one request;
    the supervisor restarts it on the same port, /v1/status shows 1 restart and metrics survive."""
    async with served_engine(enable_fault_injection=True, api_key="sekret") as (server, _):
        url, port = server.url, server.port
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, headers=KEY) as client:
            assert (await client.get("/health")).status_code == 200
            armed = await client.post("/v1/admin/faults", json={"actor": "http", "kind": "kill-listener"})
            assert armed.status_code == 200, armed.text
            with pytest.raises(httpx.TransportError):  # the connection is cut: no 500, no answer at all
                await client.get("/v1/status")
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, headers=KEY) as client:
            with trio.fail_after(10):
                while True:
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.05)
            assert server.port == port
            http = next(c for c in (await client.get("/v1/status")).json()["tree"]["children"] if c["id"] == "http")
            assert http["restarts"] == 1 and http["state"] == "running"
            assert "InjectedFault" in http["last_error"]
            assert (await client.get("/v1/admin/faults")).json() == {
                "armed": [], "fired": [{"actor": "http", "kind": "kill-listener"}]}
            metrics = (await client.get("/metrics")).text
            assert _samples(metrics, "mlx_trio_actor_restarts_total")[(("actor", "http"), ("kind", "http"))] == 1
            # Counted before the crash: the HttpServer keeps its registry across restarts.
            requests = _samples(metrics, "mlx_trio_http_requests_total")
            assert requests[(("endpoint", "/v1/admin/faults"), ("method", "POST"), ("status", "200"))] == 1


async def test_sessions_that_crash_before_any_progress_are_a_503_engine_restarted() -> None:
    """MAX_RESUMES + 1 session crashes before the first token, armed over HTTP: the documented 503
    engine_restarted with Retry-After (not a 500 actor_crashed), streamed or not; then the server serves."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with served_engine(enable_fault_injection=True) as (server, _):
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            for stream in (False, True):
                for _ in range(MAX_RESUMES + 1):
                    armed = await client.post("/v1/admin/faults", json={"actor": "session", "kind": "raise"})
                    assert armed.status_code == 200
                response = await client.post("/v1/chat/completions", json={**chat, "stream": stream})
                assert_openai_error(response, 503, code="engine_restarted")
                assert response.headers["retry-after"] == "1"
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
