"""/health, /v1/models, /v1/status, /stats and CORS, over a live server with a fake engine."""

from __future__ import annotations

import pytest

from tests.http.fakes import FakeEngine
from tests.http.http_helpers import assert_openai_error, serve_fake


async def test_health_is_503_with_the_reason_until_the_model_is_loaded() -> None:
    """/health says 503 and why while loading, then 200 {"status": "ok"} once loaded."""
    engine = FakeEngine(loaded=False)
    async with serve_fake(engine) as (_, client):
        response = await client.get("/health")
        assert response.status_code == 503
        assert response.json() == {"status": "unavailable", "reason": "loading model"}
        engine.loaded = True
        response = await client.get("/health")
        assert response.status_code == 200
        assert response.json() == {"status": "ok"}


async def test_models_lists_the_served_model_and_is_never_empty() -> None:
    """/v1/models is an OpenAI list with one model, even while loading; /v1/models/<id> finds it."""
    engine = FakeEngine(loaded=False)
    async with serve_fake(engine) as (_, client):
        loading = (await client.get("/v1/models")).json()
        assert loading["object"] == "list" and len(loading["data"]) == 1 and loading["data"][0]["id"]
        engine.loaded = True
        body = (await client.get("/v1/models")).json()
        assert body["data"][0]["id"] == "fake-model"
        assert body["data"][0]["object"] == "model"
        assert (await client.get("/v1/models/fake-model")).json()["id"] == "fake-model"
        assert_openai_error(await client.get("/v1/models/other"), 404, code="model_not_found")


async def test_model_name_from_the_config_is_used_everywhere() -> None:
    """ServerConfig.model_name overrides the engine's id in /v1/models and in responses."""
    async with serve_fake(model_name="my-model") as (_, client):
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "my-model"
        body = (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).json()
        assert body["model"] == "my-model"


async def test_status_is_the_engine_tree_plus_counters() -> None:
    """/v1/status returns Engine.status() (tree and counters) and the HTTP layer's counters."""
    async with serve_fake() as (_, client):
        body = (await client.get("/v1/status")).json()
        assert body["tree"]["id"] == "root"
        assert set(body["counters"]) >= {"active_rows", "pending_rows", "lease_queue_depth", "lease_busy_fraction"}
        # in_flight counts this very request.
        assert body["http"] == {"submitted_rows": 0, "draining": False, "in_flight": 1, "cut_by_drain": 0}


async def test_stats_reports_the_batch_fields() -> None:
    """/stats has every batch field; submitted_rows counts requests handed to the engine; no prompt cache on a fake."""
    async with serve_fake(batch=4) as (_, client):
        await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert (await client.get("/stats")).json() == {"batch": {
            "configured": 4, "mode": "serial", "active_rows": 0, "pending_rows": 0, "submitted_rows": 1,
            "kv_bytes": 0, "kv_budget_bytes": None, "decode_steps": 0, "decoded_tokens": 0, "kv_blocks": None,
        }, "prompt_cache": {"enabled": False}, "speculative": {"proposed": 0, "accepted": 0, "acceptance": 0.0}}


async def test_no_cors_headers_by_default() -> None:
    """Without --allowed-origins a cross-origin request gets no Allow-Origin, and its preflight is 403."""
    async with serve_fake() as (_, client):
        response = await client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers
        preflight = await client.options("/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert_openai_error(preflight, 403, code="origin_not_allowed")


async def test_cors_for_an_allowed_origin_with_preflight() -> None:
    """An allowed origin is echoed (with Vary: Origin); its preflight is 204 and needs no API key."""
    async with serve_fake(allowed_origins=("http://app.example",), api_key="k") as (_, client):
        headers = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "authorization, content-type"}
        preflight = await client.options("/v1/chat/completions", headers=headers)
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
        assert "Origin" in preflight.headers["vary"]
        denied = await client.get("/v1/models", headers={"Origin": "http://app.example"})
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == "http://app.example"  # so the page can read the error
        other = await client.get("/health", headers={"Origin": "http://other.example"})
        assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("origins", ["*", "http://a.example,*"])
async def test_cors_wildcard(origins: str) -> None:
    """'*' allows any origin with a literal '*'."""
    async with serve_fake(allowed_origins=origins) as (_, client):
        response = await client.get("/health", headers={"Origin": "http://anything.example"})
        assert response.headers["access-control-allow-origin"] == "*"


async def test_plain_options_without_origin_is_204_with_allow() -> None:
    """OPTIONS from a non-browser client is answered with the allowed methods."""
    async with serve_fake() as (_, client):
        response = await client.options("/v1/completions")
        assert response.status_code == 204
        assert "POST" in response.headers["allow"]


async def test_models_report_the_context_length() -> None:
    """/v1/models and /v1/models/<id> carry `context_length`, the engine's."""
    async with serve_fake(FakeEngine(context_length=4096)) as (_, client):
        assert (await client.get("/v1/models")).json()["data"][0]["context_length"] == 4096
        assert (await client.get("/v1/models/fake-model")).json()["context_length"] == 4096


async def test_root_answers_head_and_get() -> None:
    """`HEAD /` (Claude Code's connection warm-up) and `GET /` are 200; GET names the served endpoints."""
    async with serve_fake() as (_, client):
        assert (await client.head("/")).status_code == 200
        body = (await client.get("/")).json()
    assert body["model"] == "fake-model"
    assert {"POST /v1/chat/completions", "POST /v1/messages", "POST /v1/messages/count_tokens",
            "GET /v1/models"} <= set(body["endpoints"])


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/images/generations", "/v1/audio/transcriptions"])
async def test_unserved_endpoints_are_openai_404s_listing_the_served_ones(path: str) -> None:
    """Embeddings, images, audio: a 404 in OpenAI's shape whose message lists what is served."""
    async with serve_fake() as (_, client):
        error = assert_openai_error(await client.post(path, json={}), 404, code="not_found")
    assert error["message"].startswith(f"no endpoint POST {path}; this server serves ")
    assert "POST /v1/chat/completions" in error["message"] and "POST /v1/messages" in error["message"]
