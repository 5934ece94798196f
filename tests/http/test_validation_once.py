"""Semantic checks run once, in the engine: the same bad input is the same error over HTTP and from `Engine.prepare`.

A tiny Llama (ChatML: tools in the generic format) behind the real HTTP stack;
each case is sent as an OpenAI chat body, as an Anthropic Messages body
where that wire API can say it, and straight to the server's own
`Engine.prepare`. The field and message must agree everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest

from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, assert_openai_error

from mlx_trio.errors import InvalidParameter

ASK = [{"role": "user", "content": "hi"}]
OPENAI_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
CALL_G = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "g", "arguments": {}}}]}

# (case, what Engine.prepare gets, the OpenAI body's extra fields, the Anthropic body's or None, the field)
CASES = [
    ("swap the template", {"prompt": ASK, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
     {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
     {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs.chat_template"),
    ("a template argument the engine sets", {"prompt": ASK, "chat_template_kwargs": {"add_generation_prompt": False}},
     {"chat_template_kwargs": {"add_generation_prompt": False}},
     {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ("a history call to a tool not in tools", {"prompt": [*ASK, CALL_G], "tools": [OPENAI_TOOL]},
     # Anthropic checks its own tool_use blocks against its tools while converting them, naming its
     # own field (tests/http/anthropic): the engine's message would index converted messages.
     {"messages": [*ASK, CALL_G], "tools": [OPENAI_TOOL]}, None, "messages[1].tool_calls[0].function.name"),
    ("a role that is not a string", {"prompt": [{"role": 7, "content": "hi"}]},
     {"messages": [{"role": 7, "content": "hi"}]}, None, "messages[0].role"),
    ("content of the wrong type", {"prompt": [{"role": "user", "content": 5}]},
     {"messages": [{"role": "user", "content": 5}]}, None, "messages[0].content"),
    ("a content part that is not text", {"prompt": [{"role": "user", "content": [{"type": "image_url"}]}]},
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, "messages[0].content[0]"),
]


@pytest.fixture(scope="module")
def http(live_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def _engine_error(live_server: ServerThread, kwargs: dict[str, Any]) -> InvalidParameter:
    engine = live_server.server.state.engine  # type: ignore[union-attr]
    prompt = kwargs.pop("prompt")
    with pytest.raises(InvalidParameter) as info:
        live_server.call(partial(engine.prepare, prompt, max_tokens=3, **kwargs))
    return info.value


@pytest.mark.parametrize(("case", "prepare", "openai", "anthropic", "field"), CASES, ids=[c[0] for c in CASES])
def test_the_same_bad_input_is_the_same_error_everywhere(live_server: ServerThread, http: httpx.Client, case: str,
                                                        prepare: dict[str, Any], openai: dict[str, Any],
                                                        anthropic: dict[str, Any] | None, field: str) -> None:
    """Engine.prepare, /v1/chat/completions and /v1/messages name the same field with the same message."""
    expected = _engine_error(live_server, dict(prepare))
    assert expected.field == field
    error = assert_openai_error(http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, **openai}),
                                400, code="invalid_value", param=field)
    assert error["message"] == str(expected)
    if anthropic is not None:
        response = http.post("/v1/messages", json={"messages": ASK, "max_tokens": 3, **anthropic})
        assert response.status_code == 400
        assert response.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": str(expected)}}


def test_swapping_the_template_is_refused_with_a_reason(live_server: ServerThread) -> None:
    """A request cannot replace the server's chat template: the message says so, not just "reserved"."""
    error = _engine_error(live_server, {"prompt": ASK, "chat_template_kwargs": {"chat_template": "x"}})
    assert "cannot replace the model's chat template" in str(error)
