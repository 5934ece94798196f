"""Bad input is a 400 in the API's own error shape naming the field, never a 500 (issue 21, point 4).

Against the tiny Llama behind the real stack: the failures were deep in the
engine (an `OverflowError` converting a float, a tokenizer refusing a lone
surrogate), so a fake engine would not show them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, assert_openai_error

HUGE = "1" + "0" * 400  # a JSON integer past float's range
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"prompt": "hi", "max_tokens": 2}
MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSES = {"input": "hi", "max_output_tokens": 2}
APIS = {"/v1/chat/completions": CHAT, "/v1/completions": TEXT, "/v1/messages": MESSAGES,
        "/v1/responses": RESPONSES}


@pytest.fixture(scope="module")
def http(live_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def _post_raw(http: httpx.Client, path: str, body: dict[str, Any], field: str, raw_value: str) -> httpx.Response:
    """POST `body` with `field` set to `raw_value` spliced in as JSON text (json.dumps cannot write it)."""
    text = httpx.Request("POST", "/", json={**body, field: "@@"}).content.decode()
    return http.post(path, content=text.replace('"@@"', raw_value), headers={"content-type": "application/json"})


def assert_400(response: httpx.Response, path: str, param: str) -> None:
    """A 400 in the path's API shape whose message (and, for OpenAI shapes, `param`) names the field."""
    if path == "/v1/messages":
        assert response.status_code == 400, response.text
        payload = response.json()
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        assert param in payload["error"]["message"], payload
    else:
        assert param in assert_openai_error(response, 400, param=param)["message"]


@pytest.mark.parametrize("path", list(APIS))
@pytest.mark.parametrize(("field", "raw"), [("temperature", HUGE), ("top_p", HUGE), ("temperature", "1e400"),
                                            ("top_p", "-" + HUGE)])
def test_numbers_outside_float_range_are_400s(http: httpx.Client, path: str, field: str, raw: str) -> None:
    """A number JSON can write but a float cannot hold is refused at parse time, naming its field."""
    assert_400(_post_raw(http, path, APIS[path], field, raw), path, field)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"])
def test_every_float_field_is_checked(http: httpx.Client, path: str, field: str) -> None:
    """Every OpenAI float field, not only temperature."""
    assert_400(_post_raw(http, path, APIS[path], field, HUGE), path, field)


def test_a_huge_number_deep_in_the_body_names_its_path(http: httpx.Client) -> None:
    """The parse-time check names where the number sits, however deep."""
    body = {**CHAT, "logit_bias": {"5": "@@"}}
    text = httpx.Request("POST", "/", json=body).content.decode().replace('"@@"', HUGE)
    response = http.post("/v1/chat/completions", content=text, headers={"content-type": "application/json"})
    assert_400(response, "/v1/chat/completions", "logit_bias.5")


@pytest.mark.parametrize("kind", [["text"], {"a": 1}])
@pytest.mark.parametrize("where", ["block", "tool_choice", "thinking", "result_part"])
def test_anthropic_types_that_are_not_strings_are_400s(http: httpx.Client, kind: Any, where: str) -> None:
    """A `type` that is a list or an object, in a content block, tool_choice or thinking."""
    tool = {"name": "f", "input_schema": {"type": "object"}}
    bodies = {
        "block": {**MESSAGES, "messages": [{"role": "user", "content": [{"type": kind, "text": "x"}]}]},
        "tool_choice": {**MESSAGES, "tools": [tool], "tool_choice": {"type": kind}},
        "thinking": {**MESSAGES, "thinking": {"type": kind}},
        "result_part": {**MESSAGES, "tools": [tool], "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": kind, "text": "x"}]}]}]},
    }
    assert_400(http.post("/v1/messages", json=bodies[where]), "/v1/messages", "type")


@pytest.mark.parametrize("kwargs", [[1], "x", 3])
def test_anthropic_thinking_with_non_object_template_kwargs_is_a_400(http: httpx.Client, kwargs: Any) -> None:
    body = {**MESSAGES, "thinking": {"type": "disabled"}, "chat_template_kwargs": kwargs}
    assert_400(http.post("/v1/messages", json=body), "/v1/messages", "chat_template_kwargs")


@pytest.mark.parametrize("path", list(APIS))
def test_a_lone_surrogate_in_the_prompt_is_a_400(http: httpx.Client, path: str) -> None:
    """`"\\ud800"` parses to a str no tokenizer can encode: refused at parse time, naming where it sits."""
    body = {**APIS[path]}
    field = {"/v1/completions": "prompt", "/v1/responses": "input"}.get(path, "messages")
    text = httpx.Request("POST", "/", json=body).content.decode()
    if field == "messages":
        text = text.replace('"content":"hi"', '"content":"a\\ud800b"')
        param = "messages[0].content"
    else:
        text = text.replace(f'"{field}":"hi"', f'"{field}":"\\udfff"')
        param = field
    assert "\\ud" in text
    response = http.post(path, content=text, headers={"content-type": "application/json"})
    assert_400(response, path, param)


def test_a_surrogate_pair_is_a_character_not_an_error(http: httpx.Client) -> None:
    """A valid pair (an emoji escaped as two \\u escapes) is one character, served as usual."""
    text = httpx.Request("POST", "/", json=CHAT).content.decode().replace('"hi"', '"\\ud83d\\ude00"')
    response = http.post("/v1/chat/completions", content=text, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
