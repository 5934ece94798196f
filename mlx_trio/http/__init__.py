"""The OpenAI-compatible HTTP/SSE server: wire formats only, a client of the embeddable API.

Never imports MLX (checked by tests/test_architecture.py): every request goes
through `Engine.prepare` / `Engine.stream`.

Names are imported lazily, so that `mlx-trio serve` can read its flags and
check its port before quart and hypercorn load (a busy port fails at once).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what `__getattr__` hands out, for type checkers and the room graph (tests/test_architecture.py)
    from mlx_trio.http.server.app import create_app
    from mlx_trio.http.server.config import ServerConfig
    from mlx_trio.http.server.http_server import HttpServer

_EXPORTS = {
    "create_app": "mlx_trio.http.server.app",
    "ServerConfig": "mlx_trio.http.server.config",
    "HttpServer": "mlx_trio.http.server.http_server",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlx_trio.http' has no attribute {name!r}")
