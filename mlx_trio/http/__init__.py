"""The OpenAI-compatible HTTP/SSE server: wire formats only, a client of the embeddable API.

Never imports MLX (checked by tests/test_architecture.py): every request goes
through `Engine.prepare` / `Engine.stream`.
"""

from mlx_trio.http.app import create_app
from mlx_trio.http.config import ServerConfig
from mlx_trio.http.server import HttpServer

__all__ = ["HttpServer", "ServerConfig", "create_app"]
