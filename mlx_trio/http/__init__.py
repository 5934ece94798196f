"""The OpenAI-compatible HTTP/SSE server: wire formats only, a client of the embeddable API.

Never imports MLX (checked by tests/test_architecture.py): every request goes
through `Engine.prepare` / `Engine.stream`.
"""

from mlx_trio.http.server.app import create_app
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.http.server.http_server import HttpServer

__all__ = ["HttpServer", "ServerConfig", "create_app"]
