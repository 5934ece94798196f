"""The read-only endpoints: /health, /v1/models, /v1/status, /stats (and /metrics, in prometheus.py)."""

from __future__ import annotations

import json
from typing import Any

from quart import Quart, Response, request

from mlx_trio.http.server.errors import model_not_found
from mlx_trio.errors import MlxTrioError
from mlx_trio.http.server.fresh_status import fresh_status
from mlx_trio.http.server.state import AppState

# The name every client may use for the one served model.
DEFAULT_MODEL_ALIAS = "default"


def json_response(payload: Any, status: int = 200) -> Response:
    # default=str: status values (enums, paths) must never turn a probe into a 500.
    return Response(json.dumps(payload, default=str), status=status, mimetype="application/json")


def status_payload(state: AppState, status: dict[str, Any] | None = None) -> dict[str, Any]:
    """What `GET /v1/status` answers: `status` (default `Engine.status()`) plus the HTTP layer's counters."""
    return {**(status if status is not None else state.engine.status()), "http": {
        "submitted_rows": state.submitted_rows, "draining": state.draining,
        "in_flight": state.drain.in_flight, "cut_by_drain": state.drain.cut_requests}}


def _settings(state: AppState) -> dict[str, Any]:
    return {"settings": [{"name": name, "value": value, "source": source}
                         for name, value, source in state.config.settings]}


def register_info(app: Quart, state: AppState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 only when the model is loaded and every engine actor runs; 503 with the reason otherwise.

        `details` names what works in a degraded way without failing requests
        (the prompt cache's SSD tier turned off by a hung disk; a KV budget shrunk
        because the device is short of memory: "degraded: memory ..." with the
        numbers), when anything does.
        `?settings=1` adds `settings`: each `mlx-trio serve` flag's effective value
        and where it came from (default, flag, environment); probes poll without it.
        """
        extra = _settings(state) if request.args.get("settings") else {}
        if state.draining:
            return json_response({"status": "draining", "reason": "draining: the server is shutting down",
                                  **extra}, 503)
        ok, reason = state.engine.health()
        details = _degraded(state)
        body = {"status": "ok"} if ok else {"status": "unavailable", "reason": reason}
        return json_response({**body, **({"details": details} if details else {}), **extra}, 200 if ok else 503)

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
        """The live supervision tree and engine counters (`Engine.status()`, as of now), plus HTTP counters."""
        return json_response(status_payload(state, await fresh_status(state.engine)))

    @app.get("/stats")
    async def stats() -> Response:
        """`{"batch": {...}, "prompt_cache": {...}, "speculative": {...}}`: the engine's counters where it reports
        them, else the HTTP layer's view. `speculative.acceptance` is accepted / proposed (0 before any proposal).
        As of now: a response its client already has is counted, whichever process answers (`fresh_status`)."""
        status = await fresh_status(state.engine)
        counters = status.get("counters", {})
        fallback = {
            "configured": state.config.batch, "mode": "serial", "active_rows": 0, "pending_rows": 0,
            "submitted_rows": state.submitted_rows, "kv_bytes": 0, "kv_budget_bytes": None,
            "decode_steps": 0, "decoded_tokens": 0,
            "kv_blocks": None,  # --kv-layout paged: blocks total / used / shared / cached / free, prefix tokens reused
        }
        proposed, accepted = counters.get("speculative_proposed", 0), counters.get("speculative_accepted", 0)
        return json_response({"batch": {key: counters.get(key, default) for key, default in fallback.items()},
                              "prompt_cache": status.get("prompt_cache", {"enabled": False}),
                              "speculative": {"proposed": proposed, "accepted": accepted,
                                              "acceptance": accepted / proposed if proposed else 0.0}})


def _degraded(state: AppState) -> dict[str, str]:
    """What runs degraded, and why, from `Engine.status()`: the SSD tier, and a KV budget memory has shrunk."""
    status = state.engine.status()
    details = {}
    ssd = status.get("prompt_cache", {}).get("ssd", {})
    if ssd.get("degraded"):
        details["prompt_cache_ssd"] = ssd.get("reason") or "degraded"
    memory = status.get("memory") or {}
    if memory.get("degraded"):
        details["memory"] = memory.get("reason") or "degraded: memory"
    return details


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

