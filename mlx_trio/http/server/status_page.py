"""The live status page: `GET /status` (one HTML file), `GET /v1/status/events` (SSE) and `GET /`.

`/status` is a self-contained page (`status_page.html`: no CDN, no build
step, vanilla JS) that draws the supervision tree, the batch, the prompt
cache and sparklines from `/v1/status/events`. That stream sends a snapshot
(`GET /v1/status` plus what the page needs besides) every
`SNAPSHOT_EVERY_S`, and at once when the supervision tree changes: the tree
is read every `WATCH_EVERY_S` and a child's state or restart count that
moved is news, so a restart reaches the page within a fraction of a second.

The page itself holds no data, so it is public like `/health`; behind
`--api-key` it asks for the key and sends it as a bearer header on the
event stream (fetch, not EventSource, which cannot send headers; the key
never goes into a URL, where logs and history would keep it).

A stream counts as a request in flight, so it ends when the server starts
draining: an open page must never hold a shutdown for `--shutdown-timeout`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from importlib import resources
from typing import Any

import trio
from prometheus_client import Histogram
from quart import Quart, Response, redirect, request

from mlx_trio.http.server import sse
from mlx_trio.http.server.admin import fault_object
from mlx_trio.http.server.errors import served_endpoints
from mlx_trio.http.server.info import json_response, status_payload
from mlx_trio.http.server.state import AppState

STATUS_PATH = "/status"
# A snapshot at least this often, whether or not anything changed.
SNAPSHOT_EVERY_S = 0.5
# How often the tree is read for news (a state or a restart count that moved).
WATCH_EVERY_S = 0.1
# No inline handler attributes, no outside origin: the page talks to its own server only.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")


def register_status_page(app: Quart, state: AppState) -> None:
    page = resources.files(__package__).joinpath("status_page.html").read_bytes()

    @app.get(STATUS_PATH)
    async def status_page() -> Response:
        return Response(page, status=200, mimetype="text/html", headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"})

    @app.get("/v1/status/events")
    async def status_events() -> Response:
        """SSE: `data: <snapshot>` every `SNAPSHOT_EVERY_S` and on supervision news; one snapshot while draining."""
        response = Response(_snapshots(state), status=200, headers=sse.HEADERS, mimetype="text/event-stream")
        response.timeout = None  # quart-trio bounds a response by 60 s; a page stays open for hours
        return response


def register_root(app: Quart, state: AppState) -> None:
    """`/`: browsers go to the status page; `HEAD /` and other clients get a 200 (agent CLIs probe it)."""
    @app.route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        if request.method == "HEAD":
            return Response(b"", status=200)  # Claude Code sends `HEAD /` to warm a connection up
        # By the Accept header's qualities (RFC 9110, section 12.5.1): browsers prefer text/html and get the page;
        # curl and the SDKs send */* (JSON listed first wins a tie) or JSON and get the index.
        if request.accept_mimetypes.best_match(["application/json", "text/html"]) == "text/html":
            return redirect(STATUS_PATH, 302)
        return json_response({"object": "mlx-trio", "model": state.model_name(), "status_page": STATUS_PATH,
                              "endpoints": served_endpoints(app)})


def snapshot(state: AppState) -> dict[str, Any]:
    """`GET /v1/status`, plus the clock, the TTFT totals and, with fault injection, the faults."""
    faults = state.engine.faults
    count, total_s = _histogram_totals(state.metrics.ttft)
    return {
        **status_payload(state),
        "time": time.time(),
        "ttft": {"count": count, "sum_s": total_s},
        "fault_injection": state.config.enable_fault_injection,
        "faults": ({"armed": [fault_object(f) for f in faults.armed()],
                    "fired": [fault_object(f) for f in faults.fired]}
                   if state.config.enable_fault_injection else None),
    }


def tree_signature(node: dict[str, Any]) -> tuple[tuple[str, str, int], ...]:
    """What a change of must reach the page at once: each supervised child's id, state and restarts.

    Sessions (temporary children) come and go with every request: they are
    left out, or every request would be news.
    """
    return tuple(_signature(node))


def _signature(node: dict[str, Any]) -> Iterator[tuple[str, str, int]]:
    yield str(node.get("id")), str(node.get("state")), int(node.get("restarts") or 0)
    for child in node.get("children", ()):
        if child.get("restart") != "temporary":
            yield from _signature(child)


async def _snapshots(state: AppState) -> AsyncIterator[bytes]:
    last_signature: tuple[tuple[str, str, int], ...] | None = None
    last_sent_s = -SNAPSHOT_EVERY_S
    while True:
        # Read once: the last snapshot sent must be the one that says "draining".
        draining = state.draining
        current = snapshot(state)
        signature = tree_signature(current.get("tree", {}))
        now_s = trio.current_time()
        if signature != last_signature or now_s - last_sent_s >= SNAPSHOT_EVERY_S or draining:
            yield sse.event(current)
            last_signature, last_sent_s = signature, now_s
        if draining:
            return
        await trio.sleep(WATCH_EVERY_S)


def _histogram_totals(histogram: Histogram) -> tuple[float, float]:
    """(count, sum) of an unlabelled prometheus-client histogram, through its public `collect()`."""
    count = total = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return count, total
