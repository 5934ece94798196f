"""The read-only endpoints: /health, /v1/models, /v1/status, /stats (and /metrics, in prometheus.py)."""

from __future__ import annotations

import json
from typing import Any

from quart import Quart, Response

from mlx_trio.http.server.errors import model_not_found
from mlx_trio.errors import MlxTrioError
from mlx_trio.http.server.state import AppState

# The name every client may use for the one served model.
DEFAULT_MODEL_ALIAS = "default"


def json_response(payload: Any, status: int = 200) -> Response:
    # default=str: status values (enums, paths) must never turn a probe into a 500.
    return Response(json.dumps(payload, default=str), status=status, mimetype="application/json")


def status_payload(state: AppState) -> dict[str, Any]:
    """What `GET /v1/status` answers: `Engine.status()` plus the HTTP layer's counters."""
    return {**state.engine.status(), "http": {
        "submitted_rows": state.submitted_rows, "draining": state.draining,
        "in_flight": state.drain.in_flight, "cut_by_drain": state.drain.cut_requests}}


def register_info(app: Quart, state: AppState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 only when the model is loaded and every engine actor runs; 503 with the reason otherwise.

        `details` names what works in a degraded way without failing requests
        (the prompt cache's SSD tier turned off by a hung disk), when anything does.
        """
        if state.draining:
            return json_response({"status": "draining", "reason": "draining: the server is shutting down"}, 503)
        ok, reason = state.engine.health()
        details = _degraded(state)
        body = {"status": "ok"} if ok else {"status": "unavailable", "reason": reason}
        return json_response({**body, "details": details} if details else body, 200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        """The base model, then each served adapter (vLLM's shape: `parent` is the base model's id)."""
        adapters = [_adapter_object(state, name) for name in state.engine.served_adapters()]
        return json_response({"object": "list", "data": [_model_object(state), *adapters]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        # "default" too: the docs tell clients to send model="default", and some look the model up first.
        if model_id in state.engine.served_adapters():
            return json_response(_adapter_object(state, model_id))
        if model_id not in (state.model_name(), DEFAULT_MODEL_ALIAS):
            raise model_not_found(model_id, ", ".join([state.model_name(), *state.engine.served_adapters()]))
        return json_response(_model_object(state))

    @app.get("/v1/status")
    async def status() -> Response:
        """The live supervision tree and engine counters (`Engine.status()`), plus HTTP counters."""
        return json_response(status_payload(state))

    @app.get("/stats")
    async def stats() -> Response:
        """`{"batch": {...}, "prompt_cache": {...}, "speculative": {...}}`: the engine's counters where it reports
        them, else the HTTP layer's view. `speculative.acceptance` is accepted / proposed (0 before any proposal)."""
        status = state.engine.status()
        counters = status.get("counters", {})
        fallback = {
            "configured": state.config.batch, "mode": "serial", "active_rows": 0, "pending_rows": 0,
            "submitted_rows": state.submitted_rows, "kv_bytes": 0, "kv_budget_bytes": None,
            "decode_steps": 0, "decoded_tokens": 0,
            "kv_blocks": None,  # --paged-kv: blocks total / used / shared / cached / free, prefix tokens reused
        }
        proposed, accepted = counters.get("speculative_proposed", 0), counters.get("speculative_accepted", 0)
        return json_response({"batch": {key: counters.get(key, default) for key, default in fallback.items()},
                              "prompt_cache": status.get("prompt_cache", {"enabled": False}),
                              "speculative": {"proposed": proposed, "accepted": accepted,
                                              "acceptance": accepted / proposed if proposed else 0.0}})


def _degraded(state: AppState) -> dict[str, str]:
    """What runs degraded, and why: for now the SSD tier, from `Engine.status()`."""
    ssd = state.engine.status().get("prompt_cache", {}).get("ssd", {})
    return {"prompt_cache_ssd": ssd.get("reason") or "degraded"} if ssd.get("degraded") else {}


def _adapter_object(state: AppState, name: str) -> dict[str, Any]:
    return {**_model_object(state), "id": name, "parent": state.model_name(), "root": state.model_name()}


def _model_object(state: AppState) -> dict[str, Any]:
    """OpenAI's model object, plus `context_length` (prompt plus answer tokens; null while loading or unknown)."""
    try:
        context_length = state.engine.context_length
    except MlxTrioError:
        context_length = None
    return {"id": state.model_name(), "object": "model", "created": state.started_at, "owned_by": "mlx-trio",
            "context_length": context_length}

