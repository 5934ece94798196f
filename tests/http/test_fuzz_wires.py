"""Hypothesis over the Anthropic Messages and OpenAI Responses bodies, and raw bytes on every wire.

Like tests/http/test_fuzz.py (chat and text completions): every body gets a 200 whose stream ends
cleanly, or a 4xx in its own API's error shape; never a 5xx, a dropped connection or an actor
restart. The quick run is in the default suite; `-m slow` sends more than 5,000 bodies.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http.http_helpers import sse_events
from tests.http.test_fuzz import (  # noqa: F401  (http: the module's client fixture, shared)
    FIELDS, _restarts, http, junk, max_tokens, mostly, raw_bodies, small_text, with_junk)

SAMPLING = {name: FIELDS[name] for name in ("temperature", "top_p", "top_k", "seed", "stream")}
TOOL_SCHEMA = mostly(st.just({"type": "object", "properties": {"x": {"type": "string"}}}), junk)

# -- Anthropic Messages -------------------------------------------------------------------------------

block = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(["text", "tool_use", "tool_result", "thinking"]),
                    st.sampled_from(["image", "redacted_thinking", ""]) | junk)},
    optional={"text": small_text, "id": st.sampled_from(["t1", "t2"]), "tool_use_id": st.sampled_from(["t1", "t9"]),
              "name": st.sampled_from(["f", "g"]), "input": mostly(st.just({"x": "y"}), junk),
              "content": small_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": small_text}),
                                               max_size=2),
              "thinking": small_text, "signature": small_text, "is_error": st.booleans()},
)
anthropic_message = st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["user", "assistant", "system"]), st.text(max_size=5) | junk),
    "content": mostly(small_text, st.lists(block, max_size=3) | junk),
})
anthropic_bodies = with_junk(st.fixed_dictionaries(
    {"model": st.just("claude-sonnet-4-5"), "max_tokens": max_tokens,
     "messages": st.lists(anthropic_message, min_size=1, max_size=3)},
    optional={**SAMPLING, "system": small_text | st.lists(st.fixed_dictionaries(
                  {"type": st.just("text"), "text": small_text}), max_size=2),
              "stop_sequences": st.lists(st.text(min_size=1, max_size=4), max_size=2),
              "thinking": st.fixed_dictionaries({"type": mostly(st.sampled_from(["adaptive", "enabled", "disabled"]),
                                                                junk)},
                                                optional={"budget_tokens": mostly(st.integers(1, 64), junk)}),
              "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]),
                                                       "input_schema": TOOL_SCHEMA}), max_size=2),
              "tool_choice": st.fixed_dictionaries({"type": mostly(st.sampled_from(["auto", "any", "none", "tool"]),
                                                                   junk)},
                                                   optional={"name": st.sampled_from(["f", "g"])})},
), ["messages", "system", "max_tokens", "thinking", "tools", "tool_choice", "temperature"])

# -- OpenAI Responses ------------------------------------------------------------------------------------

item = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]),
                    st.sampled_from(["input_image", "custom_tool_call", ""]) | junk)},
    optional={"role": mostly(st.sampled_from(["user", "assistant", "system", "developer"]), junk),
              "content": small_text | st.lists(st.fixed_dictionaries(
                  {"type": mostly(st.sampled_from(["input_text", "output_text"]), junk), "text": small_text}),
                  max_size=2),
              "call_id": st.sampled_from(["c1", "c2"]), "name": st.sampled_from(["f", "g"]),
              "arguments": mostly(st.just('{"x": "y"}'), small_text), "output": small_text},
)
responses_bodies = with_junk(st.fixed_dictionaries(
    {"input": mostly(st.text(min_size=1, max_size=30), st.lists(item, max_size=3) | junk)},
    optional={**SAMPLING, "instructions": small_text, "max_output_tokens": max_tokens, "store": st.booleans(),
              "previous_response_id": small_text,
              "tools": st.lists(st.fixed_dictionaries({"type": mostly(st.just("function"), junk),
                                                       "name": st.sampled_from(["f", "g"]),
                                                       "parameters": TOOL_SCHEMA}), max_size=2),
              "tool_choice": mostly(st.sampled_from(["auto", "none", "required"]), junk),
              "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
                  {"type": mostly(st.sampled_from(["text", "json_object"]), junk)})})},
), ["input", "instructions", "tools", "tool_choice", "text", "max_output_tokens"])


def assert_200_or_anthropic_4xx(response: httpx.Response) -> None:
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = sse_events(response.text)
            assert events[-1].startswith("event: message_stop"), response.text[-300:]
            assert not any(e.startswith("event: error") for e in events), response.text
        else:
            assert response.json()["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
        return
    assert 400 <= response.status_code < 500, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]


def assert_200_or_responses_4xx(response: httpx.Response) -> None:
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            types = [json.loads(line[6:])["type"] for e in sse_events(response.text)
                     for line in e.split("\n") if line.startswith("data: ")]
            assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
            assert "error" not in types and "response.failed" not in types, types
        else:
            assert response.json()["status"] in ("completed", "incomplete")
        return
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


WIRES = {"/v1/messages": assert_200_or_anthropic_4xx, "/v1/responses": assert_200_or_responses_4xx}
BODIES = {"/v1/messages": anthropic_bodies, "/v1/responses": responses_bodies}
_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]


@pytest.mark.parametrize("path", sorted(WIRES))
@settings(max_examples=50, suppress_health_check=_CHECKS)
@given(data=st.data())
def test_random_bodies(http: httpx.Client, path: str, data: st.DataObject) -> None:
    """Random Messages and Responses bodies: 200 (a clean stream) or that API's 4xx, never a 5xx."""
    WIRES[path](http.post(path, json=data.draw(BODIES[path])))


@settings(max_examples=30)
@given(raw=raw_bodies, path=st.sampled_from(sorted(WIRES)))
def test_random_raw_bodies_on_the_other_wires(http: httpx.Client, raw: bytes, path: str) -> None:
    """Arbitrary bytes and JSON values as Messages or Responses bodies: that API's 4xx, never a 5xx."""
    WIRES[path](http.post(path, content=raw))


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(WIRES))
@settings(max_examples=2000, suppress_health_check=_CHECKS)  # with the rest: more than 5,000 bodies in all
@given(data=st.data())
def test_many_random_bodies(http: httpx.Client, path: str, data: st.DataObject) -> None:
    WIRES[path](http.post(path, json=data.draw(BODIES[path])))


@pytest.mark.slow
@settings(max_examples=1500)
@given(raw=raw_bodies, path=st.sampled_from([*sorted(WIRES), "/v1/chat/completions", "/v1/completions"]))
def test_many_raw_bodies(http: httpx.Client, raw: bytes, path: str) -> None:
    response = http.post(path, content=raw)
    assert 400 <= response.status_code < 500 or response.status_code == 200, response.text


def test_no_actor_restarted_and_the_server_serves_after_the_fuzzing(http: httpx.Client) -> None:
    """After all of the above (module order): healthy, no actor ever restarted, both wires serve."""
    assert http.get("/health").json() == {"status": "ok"}
    assert _restarts(http.get("/v1/status").json()["tree"]) == 0
    ok = http.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1
    ok = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {"input": "hi", "tools": [{"type": ["function"], "name": "f"}]}, "tools[0].type"),
    ("/v1/responses", {"input": [{"type": {"a": 1}, "role": "user", "content": "hi"}]}, "input[0].type"),
    ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": [{"type": [1], "text": "x"}]}]},
     "input[0].content[0].type"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": []}}, "tool_choice.type"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": {}}}}, "text.format.type"),
])
def test_a_type_that_is_not_a_string_is_a_400_naming_it(http: httpx.Client, path: str, body: dict[str, Any],
                                                         param: str) -> None:
    """Found by the fuzz above: a list or object as a `type` was a TypeError (500) in a set lookup."""
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
