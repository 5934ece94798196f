"""The official SDKs pointed at a module's `server` fixture (a `ServerThread`): the live tool-call tests' clients."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def claude(server: ServerThread) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk
