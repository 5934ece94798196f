"""Logprobs and response_format through the official `openai` SDK, against a live tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from tests.http.http_helpers import ServerThread

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time there was"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["old", "big"]}, "maxItems": 2},
    },
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(live_server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


def _check_chat_logprob(item: Any, top: int) -> None:
    assert isinstance(item.token, str) and isinstance(item.logprob, float) and item.logprob <= 0.0
    assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    assert len(item.top_logprobs) == top
    values = [t.logprob for t in item.top_logprobs]
    assert values == sorted(values, reverse=True)
    # Greedy: the sampled token is the most likely one, with the same logprob.
    assert (item.top_logprobs[0].token, item.top_logprobs[0].logprob) == (item.token, item.logprob)


def test_chat_logprobs_non_streamed_and_streamed(client: openai.OpenAI) -> None:
    """logprobs + top_logprobs=3: one entry per visible token, in OpenAI's shape; the stream carries the same."""
    whole = client.chat.completions.create(model="any", messages=CHAT, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens - (choice.finish_reason == "stop")  # EOS is not shown
    assert "".join(item.token for item in content) == choice.message.content
    for item in content:
        _check_chat_logprob(item, 3)
    chunks = list(client.chat.completions.create(model="any", messages=CHAT, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob, i.bytes) for i in streamed] == [(i.token, i.logprob, i.bytes) for i in content]
    plain = client.chat.completions.create(model="any", messages=CHAT, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content


def test_text_completion_logprobs_legacy_shape(client: openai.OpenAI) -> None:
    """/v1/completions `logprobs: 2`: tokens, token_logprobs, top_logprobs dicts and text offsets; same streamed."""
    whole = client.completions.create(model="any", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 6
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and top[token] == logprob == max(top.values())
    chunks = list(client.completions.create(model="any", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                            stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_json_schema_output_parses_and_validates(client: openai.OpenAI) -> None:
    """response_format json_schema: the answer is JSON that validates, finish "stop", streamed or not."""
    for temperature in (0.0, 1.0):
        done = client.chat.completions.create(model="any", messages=CHAT, max_tokens=120, temperature=temperature,
                                              seed=1, response_format=JSON_SCHEMA_FORMAT)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), SCHEMA)
    chunks = list(client.chat.completions.create(model="any", messages=CHAT, max_tokens=120, temperature=0,
                                                 response_format=JSON_SCHEMA_FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    """response_format json_object on a text completion, with `}` favoured: `{}` and "stop"."""
    from tokenizers import Tokenizer

    from mlx_trio.testing.tiny_models import LLAMA, tiny_model

    close = Tokenizer.from_file(str(tiny_model(LLAMA) / "tokenizer.json")).encode("}").ids[0]
    done = client.completions.create(model="any", prompt=PROMPT, max_tokens=20, logit_bias={str(close): 30},
                                     extra_body={"response_format": {"type": "json_object"}})
    assert done.choices[0].finish_reason == "stop"
    assert json.loads(done.choices[0].text) == {}


@pytest.mark.parametrize(("kwargs", "param", "says"), [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"extra_body": {"logprobs": "yes"}}, "logprobs", "boolean"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format", "strnig"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "JSON schema object"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
])
def test_bad_logprobs_and_response_format_are_400(client: openai.OpenAI, kwargs: dict[str, Any], param: str,
                                                   says: str) -> None:
    """Out-of-range or mistyped logprobs fields and unenforceable schemas are 400s naming the field."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="any", messages=CHAT, max_tokens=4, **kwargs)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert says in info.value.message
