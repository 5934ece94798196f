"""`ServerConfig`: everything the HTTP layer needs besides the engine, as one frozen value."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

# OpenAI bodies are small; 4 MiB leaves room for long chats while bounding memory per request.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Stored Responses API responses (with their input items) kept in RAM, least recently used dropped first.
DEFAULT_RESPONSES_STORE_BYTES = 64 * 1024 * 1024
# Long enough to upload a 4 MiB body over a slow link; bounded so that a client trickling or
# stalling its body cannot hold a request, and a drain, for long (--body-timeout).
DEFAULT_BODY_TIMEOUT_S = 30.0


def _origins(value: Iterable[str] | str | None) -> tuple[str, ...]:
    """Accept mlx_lm.server's comma list as well as a sequence of origins (each of which may be such a list)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    return tuple(o.strip().rstrip("/") for item in items for o in item.split(",") if o.strip())


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


@attrs.frozen
class ServerConfig:
    """How the OpenAI-compatible server listens and what it lets through.

    `port` 0 binds a free port (read it back from `HttpServer.port`).
    `api_key` None means no authentication; otherwise every endpoint but
    `/health`, `/status` and `/` (`guards.PUBLIC_PATHS`; and CORS preflights)
    needs `Authorization: Bearer <api_key>`.
    `allowed_origins` are the browser origins given CORS headers; `"*"` allows
    any; empty means same-origin only. `model_name` is the id reported in
    `/v1/models` and responses (None: the engine's model id).
    `chat_template_args` are defaults under each request's
    `chat_template_kwargs` (mlx_lm.server's `--chat-template-args`).
    `batch` is the configured decode concurrency (None: `--batch auto`), reported
    by `/stats` when the engine does not report it itself. `enable_fault_injection` serves
    `GET/POST /v1/admin/faults` (404 otherwise). `shutdown_timeout_s` is how
    long a graceful drain (`HttpServer.drain`, SIGTERM in `mlx-trio serve`)
    lets running requests finish before it cuts them. `strict_max_tokens`
    refuses (400) a `max_tokens` over the room the prompt leaves in the
    context instead of lowering it to that room. `keep_billing_header` keeps
    Claude Code's per-request `x-anthropic-billing-header` system block in
    the prompt (by default it is dropped: docs/harnesses.md, prefix hygiene).
    `responses_store_bytes` bounds the RAM of stored `/v1/responses` results
    (0: nothing is stored). `write_timeout_s` is how long one write of a
    response may wait for a client that does not read (`--write-timeout`);
    past it the stream ends and its request is freed. `body_timeout_s` is
    how long after a request's start its whole body must be in
    (`--body-timeout`); past it the answer is 408 `request_timeout`.
    """

    host: str = "127.0.0.1"
    port: int = attrs.field(default=8080, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=_origins)
    max_body_bytes: int = attrs.field(default=DEFAULT_MAX_BODY_BYTES, validator=attrs.validators.gt(0))
    model_name: str | None = None
    chat_template_args: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping, hash=False)
    batch: int | None = attrs.field(default=1, validator=attrs.validators.optional(attrs.validators.ge(1)))
    # How long hypercorn lets in-flight requests finish once the server task is cancelled
    # (after a drain there are none left; without one, e.g. in tests, this is the only grace).
    graceful_timeout_s: float = 3.0
    enable_fault_injection: bool = False
    shutdown_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.ge(0.0))
    strict_max_tokens: bool = False
    keep_billing_header: bool = False
    responses_store_bytes: int = attrs.field(default=DEFAULT_RESPONSES_STORE_BYTES, validator=attrs.validators.ge(0))
    write_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0.0))
    body_timeout_s: float = attrs.field(default=DEFAULT_BODY_TIMEOUT_S, validator=attrs.validators.gt(0.0))
    # Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--enable-lora-admin; 404 otherwise).
    enable_lora_admin: bool = False
    # Front processes serving HTTP (--api-server-count, mlx_trio/link/): 0 serves it in the engine's process.
    api_server_count: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # A listening socket to serve instead of binding host:port (a front process's inherited one).
    listen_fd: int | None = None
    # (flag, value, source) of every `mlx-trio serve` setting (mlx_trio/settings.py), served by
    # /health?settings=1; empty when the server was not started from the command line.
    settings: tuple[tuple[str, Any, str], ...] = attrs.field(default=(), converter=tuple, eq=False, hash=False)
