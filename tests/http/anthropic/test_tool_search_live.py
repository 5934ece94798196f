"""Tool search through the real engine: loading a deferred tool keeps the previous turn's prompt cached.

The scripted tiny model (tests/clients/scripted_model.py, a tool-calling
template) behind the real HTTP stack. The first request is Claude Code
2.1.332's shape (its ToolSearch tool and a deferred placeholder); the second
adds the found tool to `tools` (deferred, mid-list, as Claude Code does) and
answers the search call with a `tool_reference`. The second request must read
the whole first prompt from the prompt cache, bar the generation prompt's
tail: nothing in front of the tool result changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.clients.scripted_model import scripted_model
from tests.http.anthropic.test_tool_search import ASK, BASH, LOADED, PLACEHOLDER, SEARCH, SEARCH_USE, WEATHER
from tests.http.http_helpers import ServerThread

from mlx_trio.config import EngineConfig
from mlx_trio.http import ServerConfig

REPLY = "The tiny model says pong."
# The cache shares whole prompt tokens up to the first difference: the first prompt's generation
# prompt (the assistant header) is where the second prompt's history goes on instead.
_TAIL_TOKENS = 32


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model: Path = scripted_model(REPLY, tmp_path_factory.mktemp("scripted"))
    with ServerThread(EngineConfig(model=str(model)), ServerConfig(port=0)) as server:
        yield server.url


def _usage(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/messages", json={"model": "claude-opus-5-5", "max_tokens": 64,
                                                      "system": "You are a coding agent. " * 40, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_loading_a_deferred_tool_keeps_the_first_prompt_cached(server_url: str) -> None:
    first = _usage(server_url, {"tools": [BASH, SEARCH, PLACEHOLDER], "messages": [ASK]})
    second = _usage(server_url, {"tools": [BASH, SEARCH, WEATHER, PLACEHOLDER],
                                 "messages": [ASK, {"role": "assistant", "content": [SEARCH_USE]}, LOADED]})
    first_prompt = first["input_tokens"] + first["cache_read_input_tokens"]
    assert first_prompt > 500
    assert second["cache_read_input_tokens"] >= first_prompt - _TAIL_TOKENS, (first, second)
