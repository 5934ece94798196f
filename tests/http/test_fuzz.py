"""Hypothesis: random bodies never get anything but 200 or an OpenAI-shaped 4xx, and kill nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, sse_events

# Scalars with the awkward cases: huge integers, extreme floats, unicode (surrogates excluded: not JSON-encodable).
scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3), max_leaves=6)
small_text = st.text(min_size=0, max_size=30)


def mostly(plausible: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """About one draw in eight is odd, so most requests get deep into the stack."""
    return st.integers(0, 7).flatmap(lambda i: odd if i == 0 else plausible)


parts = st.lists(st.fixed_dictionaries({"type": mostly(st.just("text"), st.sampled_from(["image_url", ""])),
                                        "text": small_text}), max_size=2)
message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant"]), st.text(max_size=5)),
     "content": mostly(small_text, st.none() | parts)},
    optional={"name": small_text},
)
# The tiny model has a 4096-token context: max_tokens is either small (fast) or over it (rejected).
max_tokens = mostly(st.integers(min_value=1, max_value=4), st.integers(-2, 0) | st.integers(5000, 2**70))
# Values of the right type, mostly in range, with out-of-range and extreme ones mixed in.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": small_text,
    "max_tokens": max_tokens,
    "max_completion_tokens": max_tokens,
    "temperature": mostly(st.floats(0, 2), st.floats(-1, 1e300)),
    "top_p": mostly(st.floats(0, 1), st.floats(-0.5, 1.5)),
    "top_k": mostly(st.integers(0, 100), st.integers(-3, 2**70)),
    "min_p": mostly(st.floats(0, 1), st.floats(-0.5, 1.5)),
    "repetition_penalty": mostly(st.floats(0, 2), st.floats(-1, 1e30)),
    "repetition_context_size": mostly(st.integers(1, 64), st.integers(-2, 2**70)),
    "presence_penalty": mostly(st.floats(-2, 2), st.floats(-1e30, 1e30)),
    "presence_context_size": mostly(st.integers(1, 64), st.integers(-2, 2**70)),
    "frequency_penalty": mostly(st.floats(-2, 2), st.floats(-1e30, 1e30)),
    "frequency_context_size": mostly(st.integers(1, 64), st.integers(-2, 2**70)),
    "logit_bias": st.dictionaries(mostly(st.integers(0, 511), st.integers(-5, 2**70)).map(str),
                                  mostly(st.floats(-100, 100), st.floats(-1e300, 1e300)), max_size=3),
    "seed": mostly(st.integers(0, 2**64 - 1), st.integers(-5, 2**70)),
    "stop": mostly(st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
                   small_text | st.lists(small_text, max_size=2)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": mostly(st.just(1), st.integers(-1, 3)),
    "user": small_text,
}


def with_junk(body: st.SearchStrategy[dict[str, Any]], keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Overwrite a field (or add an unknown one) with a value of any JSON type, in about half the bodies."""
    overrides = st.dictionaries(st.sampled_from([*keys, "junk"]) | st.text(max_size=6), junk, max_size=1)
    return st.tuples(body, overrides).map(lambda pair: {**pair[0], **pair[1]})


chat_bodies = with_junk(st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3)},
    optional={**FIELDS, "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), junk,
                                                                 max_size=2)},
), [*FIELDS, "messages", "chat_template_kwargs", "logprobs"])
text_bodies = with_junk(st.fixed_dictionaries(
    {"prompt": mostly(st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 511), min_size=1, max_size=6),
                      st.lists(st.integers(-5, 600), max_size=6) | st.lists(small_text, max_size=2) | st.just(""))},
    optional=FIELDS,
), [*FIELDS, "prompt", "echo", "suffix", "best_of"])
raw_bodies = st.binary(max_size=40) | junk.map(lambda v: json.dumps(v).encode())


@pytest.fixture(scope="module")
def http(live_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def assert_200_or_openai_4xx(response: httpx.Response) -> None:
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = sse_events(response.text)
            assert events[-1] == "data: [DONE]"
            assert not any(e.startswith('data: {"error"') for e in events), response.text
        else:
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


_SETTINGS = settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(body=chat_bodies)
def test_random_chat_bodies(http: httpx.Client, body: dict[str, Any]) -> None:
    """Random chat bodies: 200 or an OpenAI-shaped 4xx, never a 5xx or a dropped connection."""
    assert_200_or_openai_4xx(http.post("/v1/chat/completions", json=body))


@_SETTINGS
@given(body=text_bodies)
def test_random_text_bodies(http: httpx.Client, body: dict[str, Any]) -> None:
    """Random text completion bodies: 200 or an OpenAI-shaped 4xx."""
    assert_200_or_openai_4xx(http.post("/v1/completions", json=body))


@settings(max_examples=30)
@given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_random_raw_bodies(http: httpx.Client, raw: bytes, path: str) -> None:
    """Arbitrary bytes and arbitrary JSON values as bodies are 4xx, never a 5xx."""
    assert_200_or_openai_4xx(http.post(path, content=raw))


def _restarts(tree: dict[str, Any]) -> int:
    return tree.get("restarts", 0) + sum(_restarts(c) for c in tree.get("children", []))


def test_server_is_healthy_and_serves_after_the_fuzzing(http: httpx.Client) -> None:
    """After all of the above (module order): healthy, no actor ever restarted, a normal request works."""
    assert http.get("/health").json() == {"status": "ok"}
    assert _restarts(http.get("/v1/status").json()["tree"]) == 0
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
