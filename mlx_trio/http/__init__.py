"""The OpenAI-compatible HTTP/SSE server: wire formats only, a client of the embeddable API.

Never imports MLX (checked by tests/test_architecture.py): every request goes
through `Engine.prepare` / `Engine.stream`.

Names are imported lazily, so that `mlx-trio serve` can read its flags and
check its port before quart and hypercorn load (a busy port fails at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_trio.lazy import lazy_exports

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

__getattr__ = lazy_exports(__name__, _EXPORTS)
