"""Checks that run before every handler: CORS preflight, API key; and CORS response headers."""

from __future__ import annotations

import hmac

from quart import Quart, Response, request

from mlx_trio.http.server.config import ServerConfig
from mlx_trio.http.server.errors import origin_not_allowed, unauthorized

# Reachable without a key: orchestrators probe health without credentials; the status page
# holds no data (it asks for the key, and its event stream needs it) and `/` only points there.
PUBLIC_PATHS = frozenset({"/health", "/status", "/"})
ALLOWED_METHODS = "GET, POST, OPTIONS"
DEFAULT_ALLOWED_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version"
PREFLIGHT_MAX_AGE_S = 600


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    return "*" in allowed or origin.rstrip("/") in allowed


def install_guards(app: Quart, config: ServerConfig) -> None:
    """Register the before/after hooks; they run for every path, known or not."""
    expected = config.api_key.encode() if config.api_key else None

    @app.before_request
    async def preflight_and_auth() -> Response | None:
        if request.method == "OPTIONS":
            return _preflight(config)
        if expected is not None and request.path not in PUBLIC_PATHS and not _key_ok(expected):
            raise unauthorized()
        return None

    @app.after_request
    async def cors_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and origin_allowed(origin, config.allowed_origins):
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in config.allowed_origins else origin
            if "*" not in config.allowed_origins:
                response.headers.add("Vary", "Origin")
        return response


def _key_ok(expected: bytes) -> bool:
    """OpenAI clients send `Authorization: Bearer <key>`, Anthropic clients `x-api-key: <key>`; either will do."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # compare_digest: the time taken must not tell how much of the key matched.
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected):
        return True
    api_key = request.headers.get("x-api-key")
    return api_key is not None and hmac.compare_digest(api_key.strip().encode(), expected)


def _preflight(config: ServerConfig) -> Response:
    origin = request.headers.get("Origin")
    response = Response(b"", status=204)
    response.headers["Allow"] = ALLOWED_METHODS
    if origin is None:
        return response  # a plain OPTIONS, not a browser preflight
    if not origin_allowed(origin, config.allowed_origins):
        raise origin_not_allowed(origin)
    response.headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
    response.headers["Access-Control-Allow-Headers"] = (
        request.headers.get("Access-Control-Request-Headers") or DEFAULT_ALLOWED_HEADERS
    )
    response.headers["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_S)
    return response
