"""/v1/responses through the official `openai` SDK against the real engine on tiny models.

Exact where it can be: a greedy answer is mlx-lm's golden, the prompt is
the chat template's rendering of the same conversation (token counts equal
a chat completion's), and a `previous_response_id` turn reuses the first
turn's KV (cached tokens). Grammars (text.format, a forced custom tool, a
required function) make the random-weight model's answers checkable.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import httpx
import openai
import pydantic
import pytest
from tests.goldens import golden
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread
from tests.http.responses.sdk_checks import valid_response
from tests.http.test_live import _decode_counts

from mlx_trio.config import EngineConfig
from mlx_trio.http import ServerConfig
from mlx_trio.params import SamplingParams
from mlx_trio.testing import QWEN3_TOOLS, tiny_model

CASE = golden("llama", "greedy_chat")
SYSTEM, USER = CASE["prompt"][0]["content"], CASE["prompt"][1]["content"]


@pytest.fixture(scope="module")
def client(live_server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0,
                       timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


def test_a_greedy_response_is_the_golden(client: openai.OpenAI) -> None:
    """instructions + input render as the golden's system and user turns; the text is mlx-lm's, token for token."""
    response = client.responses.create(model="m", instructions=SYSTEM, input=USER, temperature=0,
                                       max_output_tokens=CASE["params"]["max_tokens"])
    valid_response(response.model_dump())
    assert response.output_text == CASE["text"]
    assert response.status == "incomplete" and response.usage is not None  # the golden ran to its max_tokens
    assert response.usage.input_tokens == len(CASE["prompt_ids"])
    assert response.usage.output_tokens == CASE["params"]["max_tokens"]
    with client.responses.stream(model="m", instructions=SYSTEM, input=USER, temperature=0,
                                 max_output_tokens=CASE["params"]["max_tokens"]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == CASE["text"]


def test_previous_response_id_reuses_the_first_turns_tokens(client: openai.OpenAI) -> None:
    """The second turn's prompt is the whole conversation (as a chat completion renders it); its first turn is cached."""
    first = client.responses.create(model="m", input="Once upon a time", temperature=0, max_output_tokens=6,
                                    extra_body={"stop": ["\n"]})
    second = client.responses.create(model="m", previous_response_id=first.id, input="And then?", temperature=0,
                                     max_output_tokens=6)
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    chat = client.chat.completions.create(model="m", temperature=0, max_tokens=6, messages=[
        {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert chat.usage is not None and second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


class City(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    visits: Literal[1, 2, 3]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """text.format json_schema constrains the answer to the schema: it always parses into the model."""
    parsed = client.responses.parse(model="m", input="Where to?", text_format=City, max_output_tokens=64)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    assert json.loads(parsed.output_text) == parsed.output_parsed.model_dump()


def test_eight_concurrent_streams_across_three_apis_share_decode_steps(live_server: ServerThread) -> None:
    """Responses, chat and Messages streams of the golden at once: each is exactly the golden, and they batch."""
    max_tokens = CASE["params"]["max_tokens"]
    start = threading.Barrier(8)

    def responses() -> str:
        with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0) as sdk:
            start.wait()
            with sdk.responses.stream(model="m", instructions=SYSTEM, input=USER, temperature=0,
                                      max_output_tokens=max_tokens) as stream:
                return "".join(e.delta for e in stream if e.type == "response.output_text.delta")

    def chat() -> str:
        with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0) as sdk:
            start.wait()
            chunks = sdk.chat.completions.create(model="m", messages=CASE["prompt"], temperature=0,
                                                 max_tokens=max_tokens, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def messages() -> str:
        with anthropic.Anthropic(base_url=live_server.url, api_key="x", max_retries=0) as sdk:
            start.wait()
            with sdk.messages.stream(model="m", system=SYSTEM, max_tokens=max_tokens,
                                     messages=[{"role": "user", "content": USER}],
                                     extra_body={"temperature": 0}) as stream:
                return "".join(stream.text_stream)

    with httpx.Client(base_url=live_server.url, timeout=CLIENT_TIMEOUT_S) as http:
        steps, tokens = _decode_counts(http)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(f) for f in (responses,) * 4 + (chat,) * 2 + (messages,) * 2]
            texts = [f.result() for f in futures]
        steps_after, tokens_after = _decode_counts(http)
    assert texts == [CASE["text"]] * 8
    assert tokens_after - tokens > 2 * (steps_after - steps)  # a serial run takes one step per token


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def tools_client() -> Iterator[openai.OpenAI]:
    config = EngineConfig(model=str(tiny_model(QWEN3_TOOLS)), defaults=SamplingParams(max_tokens=8))
    with ServerThread(config, ServerConfig(port=0)) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


def test_function_tool_round_trip_on_a_tools_model(tools_client: openai.OpenAI) -> None:
    """tool_choice required: the model calls get_weather; given its output, it answers in text."""
    first = tools_client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=200)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    second = tools_client.responses.create(
        model="m", previous_response_id=first.id, tools=[WEATHER], tool_choice="none",  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
        max_output_tokens=8)
    assert second.output[0].type == "message" and second.output_text


@pytest.mark.parametrize(("syntax", "definition", "check"), [
    ("lark", 'start: "yes" | "no"', lambda text: text in ("yes", "no")),
    ("regex", "[0-9]{3}/[a-c]", lambda text: re.fullmatch("[0-9]{3}/[a-c]", text) is not None),
])
def test_a_forced_custom_tool_follows_its_grammar(tools_client: openai.OpenAI, syntax: str, definition: str,
                                                  check: Any) -> None:
    tool = {"type": "custom", "name": "answer", "description": "Answer",
            "format": {"type": "grammar", "syntax": syntax, "definition": definition}}
    with tools_client.responses.stream(model="m", input="Answer.", tools=[tool],  # type: ignore[list-item]
                                       tool_choice={"type": "custom", "name": "answer"},
                                       max_output_tokens=20) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "custom_tool_call" and call.name == "answer" and check(call.input), call.input
