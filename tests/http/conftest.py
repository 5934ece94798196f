"""Fixtures for the HTTP tests (helpers live in http_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from http_helpers import ServerThread, tiny_engine_config

from mlx_trio.http import ServerConfig


@pytest.fixture(scope="module")
def live_server() -> Iterator[ServerThread]:
    """A tiny Llama behind the real HTTP stack on a random port, shared by a test module."""
    server = ServerThread(tiny_engine_config(), ServerConfig(port=0)).start()
    try:
        yield server
    finally:
        server.stop()
