"""The one place where errors become HTTP: status, OpenAI-shaped body, headers.

Every error a client can see, whether raised by the engine (`MlxTrioError`),
by routing and body limits (werkzeug's `HTTPException`: 404, 405, 413) or by
this package (`HttpError`: bad JSON, bad API key, CORS), goes through
`api_error`, which returns the OpenAI error object
``{"error": {"message", "type", "param", "code"}}``. Handlers never build
error bodies themselves; streams use the same value for their in-band error
event.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from mlx_trio.errors import (
    ActorCrashed,
    ContextTooLong,
    EngineDown,
    EngineFailure,
    EngineRestarted,
    InvalidParameter,
    MlxTrioError,
    ModelNotFound,
    Overloaded,
    RequestError,
)

log = logging.getLogger("mlx_trio.http")

INVALID_REQUEST = "invalid_request_error"
# The code of an unexpected exception: a bug, a crash of the handler that met it.
INTERNAL_ERROR = "internal_error"


@attrs.frozen
class ApiError:
    """An error as the client sees it."""

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=lambda h: MappingProxyType(dict(h)), hash=False)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The same error as the Anthropic API shapes it (for /v1/messages)."""
        return {"type": "error", "error": {"type": _anthropic_type(self), "message": self.message}}


# Paths whose clients expect Anthropic-shaped errors.
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error"}


def _anthropic_type(error: ApiError) -> str:
    if error.type == "overloaded_error":
        return "overloaded_error"
    if error.status >= 500:
        return "api_error"
    return _ANTHROPIC_TYPES.get(error.status, "invalid_request_error")


class HttpError(Exception):
    """An error found by the HTTP layer itself (bad JSON, bad API key, CORS)."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST, code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.error = ApiError(status, message, type, code, param, headers or {})


def invalid_json(message: str) -> HttpError:
    return HttpError(400, f"the request body is not valid JSON: {message}", code="invalid_json")


def invalid_body(got: str) -> HttpError:
    return HttpError(400, f"the request body must be a JSON object, got {got}", code="invalid_body")


def model_not_found(model_id: str, served: str) -> HttpError:
    return HttpError(404, f"the model {model_id!r} does not exist; this server serves {served!r}",
                     code="model_not_found", param="model")


def draining() -> HttpError:
    return HttpError(503, "the server is shutting down", type="engine_unavailable", code="draining",
                     headers={"Retry-After": "1"})


def shutdown_cut() -> HttpError:
    return HttpError(503, "the server shut down before this generation finished (--shutdown-timeout passed)",
                     type="engine_unavailable", code="shutdown", headers={"Retry-After": "1"})


def invalid_value(param: str, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}", code="invalid_value", param=param)


def unauthorized() -> HttpError:
    return HttpError(401, "missing or invalid API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                     type="authentication_error", code="invalid_api_key",
                     headers={"WWW-Authenticate": "Bearer"})


def origin_not_allowed(origin: str) -> HttpError:
    return HttpError(403, f"origin {origin!r} is not allowed (see --allowed-origins)", type="permission_error",
                     code="origin_not_allowed")


# werkzeug's routing and body-limit errors, by status: (type, code, message).
_HTTP_STATUS = {
    400: (INVALID_REQUEST, "bad_request", None),
    404: (INVALID_REQUEST, "not_found", None),
    405: (INVALID_REQUEST, "method_not_allowed", None),
    408: (INVALID_REQUEST, "request_timeout", "the request body did not arrive in time"),
    413: (INVALID_REQUEST, "request_too_large", None),
}


def api_error(exc: BaseException, *, max_body_bytes: int | None = None, path: str = "",
              method: str = "") -> ApiError:
    """Map any exception to what the client sees. Unknown exceptions are 500s without details."""
    if isinstance(exc, HttpError):
        return exc.error
    if isinstance(exc, ModelNotFound):
        return ApiError(404, str(exc), INVALID_REQUEST, "model_not_found", "model")
    if isinstance(exc, InvalidParameter):
        return ApiError(400, str(exc), INVALID_REQUEST, "invalid_value", exc.field)
    if isinstance(exc, ContextTooLong):
        return ApiError(400, exc.message, INVALID_REQUEST, "context_length_exceeded", exc.field)
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), INVALID_REQUEST, "invalid_request", getattr(exc, "field", None))
    if isinstance(exc, Overloaded):
        return ApiError(503, str(exc), "overloaded_error", "overloaded", headers=_retry_after(exc.retry_after_s))
    if isinstance(exc, EngineDown):
        # The engine subtree gave up; the root starts it again after the backoff.
        return ApiError(503, str(exc), "engine_unavailable", "engine_down", headers=_retry_after(exc.retry_after_s))
    if isinstance(exc, EngineRestarted):
        # Resume gave up: the engine kept failing under this request.
        return ApiError(503, str(exc), "engine_unavailable", "engine_restarted", headers={"Retry-After": "1"})
    if isinstance(exc, ActorCrashed):
        # Something broke mid-request; the supervisor restarts it, a retry may succeed.
        return ApiError(500, str(exc), "server_error", "actor_crashed")
    if isinstance(exc, EngineFailure):
        # Loading, draining or a dead lease: the engine cannot take work right now.
        return ApiError(503, str(exc), "engine_unavailable", "engine_unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, MlxTrioError):
        return ApiError(500, str(exc), "server_error", "engine_error")
    if isinstance(exc, HTTPException):
        return _from_http_exception(exc, max_body_bytes=max_body_bytes, path=path, method=method)
    return ApiError(500, "internal server error", "server_error", INTERNAL_ERROR)


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def _from_http_exception(exc: HTTPException, *, max_body_bytes: int | None, path: str, method: str) -> ApiError:
    status = exc.code or 500
    type_, code, message = _HTTP_STATUS.get(status, ("server_error" if status >= 500 else INVALID_REQUEST, None, None))
    headers: dict[str, str] = {}
    if status == 404:
        message = f"no endpoint {method} {path}".replace("  ", " ")
    elif status == 405 and isinstance(exc, MethodNotAllowed):
        allowed = sorted(exc.valid_methods or ())
        headers["Allow"] = ", ".join(allowed)
        message = f"method {method} is not allowed on {path}; use {' or '.join(allowed)}"
    elif status == 413:
        limit = f" of {max_body_bytes} bytes" if max_body_bytes else ""
        message = f"the request body is over the limit{limit}"
    return ApiError(status, message or exc.description or exc.name, type_, code, headers=headers)


def served_endpoints(app: Quart) -> list[str]:
    """"METHOD /path" for every route the app serves, sorted by path (OPTIONS and HEAD left out)."""
    routes = []
    for rule in app.url_map.iter_rules():
        methods = sorted(set(rule.methods or ()) - {"OPTIONS", "HEAD"})
        if methods and not rule.rule.startswith("/static"):
            routes.append((rule.rule, f"{' '.join(methods)} {rule.rule}"))
    return [text for _, text in sorted(routes)]


def error_response(error: ApiError, *, anthropic: bool = False) -> Response:
    body = error.anthropic_body() if anthropic else error.body()
    response = Response(_json_bytes(body), status=error.status, mimetype="application/json")
    response.headers.update(dict(error.headers))
    return response


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode()


def install_error_handlers(app: Quart, *, max_body_bytes: int,
                           on_crash: Callable[[BaseException], None] | None = None) -> None:
    """Route every exception a handler raises through `api_error` (the only mapping).

    An unexpected exception (a bug: the 500 `internal_error`) is also passed to
    `on_crash`, which counts it.

    Routing never redirects: werkzeug would answer a path with `//` with an
    HTML 308 that no API client follows; such a path is an unserved one, a 404.
    """
    app.url_map.merge_slashes = False
    async def handle(exc: Exception) -> Response:
        error = api_error(exc, max_body_bytes=max_body_bytes, path=request.path, method=request.method)
        if error.status == 404 and isinstance(exc, HTTPException):  # an unserved path: say which ones are served
            error = attrs.evolve(error, message=f"{error.message}; this server serves "
                                                f"{', '.join(served_endpoints(app))}")
        # HttpError 503s (draining, cut by the drain) are expected during a shutdown: one info line each.
        if error.status >= 500 and not isinstance(exc, HttpError):
            if isinstance(exc, (MlxTrioError, HTTPException)):
                log.warning("%s %s failed: %s", request.method, request.path, exc)
            else:  # a bug: keep the traceback
                log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
                if on_crash is not None:
                    on_crash(exc)
        else:  # the one line for a request refused before it reached the engine
            log.info("%s %s refused: %d %s%s", request.method, request.path, error.status, error.code,
                     f" ({error.param})" if error.param else "")
        return error_response(error, anthropic=request.path.startswith(ANTHROPIC_PATHS))

    # Both registrations: quart looks HTTPException handlers up by status code first.
    app.register_error_handler(HTTPException, handle)
    app.register_error_handler(Exception, handle)
