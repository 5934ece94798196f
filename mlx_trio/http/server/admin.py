"""Fault injection over HTTP, and the HTTP child's own fault points.

`GET/POST /v1/admin/faults` exist only with `ServerConfig.enable_fault_injection`
(`mlx-trio serve --enable-fault-injection`); otherwise they are 404 like any
unknown path. They need the API key like every endpoint that serves data.

The HTTP child is an actor like the others, whose work is many request
handlers at once. A `raise` fault armed for "http" crashes one handler: the
first to reach a fault point, which is a request arriving (`install_fault_point`;
the admin routes excepted, so arming and listing faults never take one) or a
running generation receiving its next event (`handler_fault_point`). That
request alone fails, exactly as a bug in its handler would: a 500
`internal_error` in its API's shape, or that error as its stream's last event;
every other request goes on untouched, and the crash is counted
(`AppState.crashes`, the `http` node's `stats`). A `kill-listener` fault kills
the server itself at the next request (`AppState.crash`): every connection is
cut, the supervisor restarts the child, and the socket is bound again on the
same port.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import trio
from quart import Quart, Response, request

from mlx_trio.http.server.body import decode_json_object
from mlx_trio.http.server.errors import invalid_value
from mlx_trio.http.server.info import json_response
from mlx_trio.http.server.fresh_status import fresh_status
from mlx_trio.http.server.state import AppState
from mlx_trio.supervision.faults import ArmedFault, FaultKind, Faults, InjectedFault

log = logging.getLogger("mlx_trio.http")

HTTP_ACTOR_ID = "http"
# The SSD tier's actor (`actors/cache_persistence.py`; the http package may not import actors).
PERSISTENCE_ID = "cache-persistence"
ADMIN_PATH = "/v1/admin/"
# Matches any session (see `mlx_trio.supervision.faults`).
ANY_SESSION = "session"
# Session ids named in an "unknown actor" message; there may be thousands.
MAX_SESSIONS_LISTED = 5


def install_fault_point(app: Quart, state: AppState) -> None:
    """Check the "http" faults first thing in every request but the admin ones."""
    @app.before_request
    async def http_fault_point() -> None:
        faults = state.engine.faults
        if request.path.startswith(ADMIN_PATH):
            return
        if faults.take(HTTP_ACTOR_ID, FaultKind.KILL_LISTENER):
            log.error("fault injected into %s: killing the listener", HTTP_ACTOR_ID)
            state.crash(InjectedFault(f"fault injected into {HTTP_ACTOR_ID} (kill-listener)"))
            # `HttpServer.run` now cancels hypercorn, this request's task with it: no response is sent.
            await trio.sleep_forever()
        faults.check(HTTP_ACTOR_ID)  # raise: this handler crashes, a 500 through the error handlers


def handler_fault_point(faults: Faults) -> None:
    """Check the "http" fault as a running generation's event arrives: an armed one crashes this handler.

    What it raises (`InjectedFault`) ends the request as any bug in its handler
    would; the handler closes its engine stream on the way out.
    """
    faults.check(HTTP_ACTOR_ID)


def register_admin(app: Quart, state: AppState) -> None:
    if not state.config.enable_fault_injection:
        return

    @app.get("/v1/admin/faults")
    async def list_faults() -> Response:
        await fresh_status(state.engine)  # an engine in another process: its lists now
        faults = state.engine.faults
        return json_response({"armed": [fault_object(f) for f in faults.armed()],
                              "fired": [fault_object(f) for f in faults.fired]})

    @app.post("/v1/admin/faults")
    async def arm_fault() -> Response:
        body = decode_json_object(await request.get_data())
        kind, actor = body.get("kind"), body.get("actor")
        kinds = [k.value for k in FaultKind]
        if kind not in kinds:
            raise invalid_value("kind", f"must be one of {', '.join(map(repr, kinds))}, got {kind!r}")
        if not isinstance(actor, str):
            raise invalid_value("actor", f"must be an actor id as GET /v1/status shows it, got {actor!r}")
        status = state.engine.status()
        present = set(actor_ids(status.get("tree", {})))
        if actor not in present and actor != ANY_SESSION:
            # A finished session's id too: it is gone from the tree, and a fault for it would never fire.
            raise invalid_value("actor", f"no actor {actor!r} in the status tree; ids present: {_listing(present)}")
        ssd = status.get("prompt_cache", {}).get("ssd", {})
        if actor == PERSISTENCE_ID and (not ssd.get("enabled") or ssd.get("degraded")):
            # Its faults fire at an entry's write or read, and without an SSD tier it has none.
            why = f"turned off ({ssd.get('reason') or 'degraded'})" if ssd.get("enabled") else "off (no --prompt-cache-dir)"
            raise invalid_value("actor", f"a fault at {actor!r} would never fire: the SSD tier is {why}")
        try:
            # An engine in another process arms it there before we answer (`RemoteEngine.arm_fault`), so
            # the client's next request, through whichever front, meets it.
            arm_fault = getattr(state.engine, "arm_fault", None)
            armed = await arm_fault(actor, kind) if arm_fault is not None else state.engine.faults.arm(actor, kind)
        except ValueError as exc:
            raise invalid_value("kind", str(exc)) from None
        log.warning("fault armed over HTTP: %s %s", armed.kind.value, armed.actor)
        return json_response({"armed": fault_object(armed)})


def actor_ids(node: dict[str, Any]) -> Iterator[str]:
    """The ids of the actors under `node`, depth first; supervisors are left out (they check no faults)."""
    for child in node.get("children", ()):
        if child.get("kind") != "supervisor":
            yield str(child.get("id"))
        yield from actor_ids(child)


def _listing(ids: set[str]) -> str:
    sessions = sorted(i for i in ids if i.startswith(f"{ANY_SESSION}-"))
    names = sorted(ids - set(sessions))
    names.append(f"{ANY_SESSION} (any session)")
    names.extend(sessions[:MAX_SESSIONS_LISTED])
    if len(sessions) > MAX_SESSIONS_LISTED:
        names.append(f"and {len(sessions) - MAX_SESSIONS_LISTED} more sessions")
    return ", ".join(names)


def fault_object(fault: ArmedFault) -> dict[str, str]:
    """An armed or fired fault as JSON-able data."""
    return {"actor": fault.actor, "kind": fault.kind.value}
