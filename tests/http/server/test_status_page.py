"""The status page: `/status`, `/`, the `/v1/status/events` stream, over a fake engine (the browser test is separate)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from tests.http.fakes import FakeEngine
from tests.http.http_helpers import assert_openai_error, serve_fake

from mlx_trio.http.server import status_page
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.http.server.drain import Drain
from mlx_trio.http.server.prometheus import Metrics
from mlx_trio.http.server.state import AppState

KEY = "sekret-status-key"


async def _first_event(client: httpx.AsyncClient, **headers: str) -> dict[str, Any]:
    async with client.stream("GET", "/v1/status/events", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended before its first snapshot")


async def test_the_page_is_one_self_contained_html_file() -> None:
    """200 text/html with a CSP that allows no other origin; it loads nothing from anywhere and follows the events."""
    async with serve_fake() as (_, client):
        response = await client.get("/status")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in response.headers["content-security-policy"]
        page = response.text
        assert "/v1/status/events" in page and "/v1/admin/faults" in page
        page = page.replace('"http://www.w3.org/2000/svg"', "")  # a namespace name, never fetched
        for outside in ("<script src", "<link", "@import", "https://", "http://"):
            assert outside not in page


async def test_root_sends_browsers_to_the_page_and_answers_other_clients() -> None:
    """GET / with Accept: text/html is a 302 to /status; other GETs and HEAD / are 200 (agent CLIs probe it)."""
    async with serve_fake() as (_, client):
        browser = await client.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
        assert browser.status_code == 302 and browser.headers["location"].endswith("/status")
        other = await client.get("/", headers={"Accept": "application/json"})
        assert other.status_code == 200 and other.json()["status_page"] == "/status"
        head = await client.head("/")
        assert head.status_code == 200


@pytest.mark.parametrize(("accept", "page"), [
    ("text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,*/*;q=0.8", True),  # Chrome, Firefox
    ("text/html", True),
    ("application/json", False),
    ("application/json, text/html;q=0.5", False),  # a JSON client that takes a page only as a fallback
    ("text/html;q=0.1, application/json", False),
    ("*/*", False),  # curl, the SDKs
    ("", False),
])
async def test_root_follows_the_accept_header_by_its_qualities(accept: str, page: bool) -> None:
    """The page when text/html is preferred to JSON (RFC 9110, section 12.5.1: by quality), else the JSON index."""
    async with serve_fake() as (_, client):
        response = await client.get("/", headers={"Accept": accept})
        if page:
            assert response.status_code == 302 and response.headers["location"].endswith("/status")
            followed = await client.get(response.headers["location"], headers={"Accept": accept})
            assert followed.headers["content-type"].startswith("text/html")
        else:
            assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
            index = response.json()
            assert index["object"] == "mlx-trio" and "/v1/chat/completions" in str(index["endpoints"])


async def test_behind_a_key_the_page_is_public_but_its_data_is_not() -> None:
    """The page and / need no key (the page asks for it); the event stream does; the key is never in the page."""
    async with serve_fake(api_key=KEY) as (_, client):
        page = await client.get("/status")
        assert page.status_code == 200 and KEY not in page.text
        assert (await client.head("/")).status_code == 200
        assert_openai_error(await client.get("/v1/status/events"), 401)
        snapshot = await _first_event(client, Authorization=f"Bearer {KEY}")
        assert snapshot["tree"]["id"] == "root"


async def test_a_snapshot_is_the_status_plus_what_the_page_draws() -> None:
    """`/v1/status` (tree, counters, http), plus the clock, the TTFT totals and, with fault injection, armed faults."""
    engine = FakeEngine()
    async with serve_fake(engine) as (_, client):
        await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
        snapshot = await _first_event(client)
        status = (await client.get("/v1/status")).json()
        assert snapshot["tree"] == status["tree"] and snapshot["counters"] == status["counters"]
        assert snapshot["http"]["submitted_rows"] == 1
        assert snapshot["ttft"]["count"] == 1 and snapshot["ttft"]["sum_s"] >= 0
        assert snapshot["fault_injection"] is False and snapshot["faults"] is None
    async with serve_fake(engine, enable_fault_injection=True) as (_, client):
        engine.faults.arm("decode-step", "raise")
        snapshot = await _first_event(client)
        assert snapshot["fault_injection"] is True
        assert snapshot["faults"]["armed"] == [{"actor": "decode-step", "kind": "raise"}]


async def test_the_stream_ends_when_the_server_drains() -> None:
    """A page left open must not hold a drain: one last snapshot says draining, then the stream ends."""
    async with serve_fake() as (server, client):
        snapshots = []
        async with client.stream("GET", "/v1/status/events") as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    snapshots.append(json.loads(line.removeprefix("data: ")))
                    server.drain_state.draining = True  # after the first: the stream must end by itself
        assert snapshots[0]["http"]["draining"] is False and snapshots[-1]["http"]["draining"] is True


async def test_models_answers_for_the_served_id_and_for_default() -> None:
    """`GET /v1/models/default` finds the served model, as the docs' model="default" promises."""
    async with serve_fake() as (_, client):
        assert (await client.get("/v1/models/default")).json()["id"] == "fake-model"
        assert (await client.get("/v1/models/fake-model")).json()["id"] == "fake-model"
        assert_openai_error(await client.get("/v1/models/other"), 404, code="model_not_found")


class RestartingEngine(FakeEngine):
    """A fake whose tree has one supervised actor and one session; `restarts` is a switch."""

    def __init__(self) -> None:
        super().__init__()
        self.restarts = 0
        self.session_tokens = 0

    def status(self) -> dict[str, Any]:
        status = super().status()
        status["tree"]["children"] = [
            {"id": "decode-step", "kind": "decode-step", "restart": "permanent", "state": "running",
             "restarts": self.restarts},
            {"id": "session-req-1", "kind": "session", "restart": "temporary", "state": "running", "restarts": 0,
             "stats": {"completion_tokens": self.session_tokens}},
        ]
        return status


def test_the_tree_signature_moves_with_restarts_and_states_not_sessions() -> None:
    engine = RestartingEngine()
    before = status_page.tree_signature(engine.status()["tree"])
    engine.session_tokens += 5
    assert status_page.tree_signature(engine.status()["tree"]) == before
    engine.restarts = 1
    assert status_page.tree_signature(engine.status()["tree"]) != before


async def test_a_restart_is_sent_at_the_next_watch_not_the_next_heartbeat(autojump_clock: trio.testing.MockClock) -> None:
    """On a virtual clock: snapshots every SNAPSHOT_EVERY_S, but a restart goes out WATCH_EVERY_S after it."""
    engine = RestartingEngine()
    state = AppState(engine, ServerConfig(), Drain(), Metrics(engine.status))
    frames = status_page._snapshots(state)
    await anext(frames)
    start_s = trio.current_time()
    await anext(frames)
    heartbeat_s = trio.current_time() - start_s
    assert status_page.SNAPSHOT_EVERY_S <= heartbeat_s < status_page.SNAPSHOT_EVERY_S + status_page.WATCH_EVERY_S
    engine.restarts = 1
    start_s = trio.current_time()
    frame = await anext(frames)
    assert trio.current_time() - start_s == pytest.approx(status_page.WATCH_EVERY_S)
    assert json.loads(frame.removeprefix(b"data: "))["tree"]["children"][0]["restarts"] == 1
    await frames.aclose()
