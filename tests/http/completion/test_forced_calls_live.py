"""A forced tool call on all three wire APIs, both template kinds, with room for the call and without (issue #44, 3).

Forced: `tool_choice` "required" or a named function (chat, Responses),
`{"type": "any"}` or `{"type": "tool"}` (Anthropic). The grammar makes the
answer start with the call at once, and its arguments validate against the
tool's schema. When max_tokens cuts the call, it is still reported as that
call, never as text, and the finish says it was cut (the policy is in
docs/api.md, "Forced tool calls"):

    chat        finish_reason "length"; the call's `arguments` is the JSON text so far
    Anthropic   stop_reason "max_tokens"; the tool_use `input` is what the SDK's stream reader
                makes of that text (what is complete of it)
    Responses   status "incomplete" (max_output_tokens); the function_call item is "incomplete"

Before the fix, each of these cut answers was one text block / message holding the call's JSON.
Random weights never close a free string, so the schema's arguments are an
enum and a bounded integer: with room, the call closes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from tests.http.http_helpers import ServerThread

from mlx_trio.config import EngineConfig
from mlx_trio.http import ServerConfig
from mlx_trio.http.completion.cut_calls import partial_json
from mlx_trio.params import SamplingParams
from mlx_trio.testing import LLAMA, QWEN3_TOOLS, tiny_model
from mlx_trio.testing.tiny_models import CHATML_TEMPLATE

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
SCHEMAS = {"get_weather": CITY, "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
FUNCTIONS = [{"name": name, "parameters": schema} for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ROOM, CUT = 200, 6


def _thinking_without_tools(directory: Path) -> Path:
    """The tiny Qwen3's vocabulary (`<think>` markers) under a ChatML template that opens `<think>` in the
    generation prompt and has no tool format: the generic format, starting inside a think span."""
    shutil.copytree(tiny_model(QWEN3_TOOLS), directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHATML_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    config_path.write_text(json.dumps(config))
    return directory


# generic: the tiny Llama's template has no tool format; native: the tiny Qwen3's Hermes `<tool_call>` JSON;
# generic-in-think: no tool format, and the prompt opens a think span (before the fix the call was reasoning).
@pytest.fixture(scope="module", params=["generic", "native", "generic-in-think"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    if request.param == "generic-in-think":
        model = _thinking_without_tools(tmp_path_factory.mktemp("model") / "thinking")
    else:
        model = tiny_model(LLAMA if request.param == "generic" else QWEN3_TOOLS)
    with ServerThread(EngineConfig(model=str(model), defaults=SamplingParams(max_tokens=8)),
                      ServerConfig(port=0)) as thread:
        yield thread


def _valid(name: str, arguments: Any) -> None:
    jsonschema.validate(arguments, SCHEMAS[name])


def _valid_so_far(name: str, arguments: str) -> None:
    """A cut call's arguments: a JSON object's start whose complete fields each validate against the schema."""
    assert arguments == "" or arguments.startswith("{")
    schema = SCHEMAS.get(name, NOTE)
    for key, value in partial_json(arguments).items():
        jsonschema.validate(value, schema["properties"][key])


def _chat_tools(schemas: dict[str, Any]) -> list[Any]:
    return [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in schemas.items()]


CHAT_CHOICES = [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]


@pytest.mark.parametrize(("choice", "name"), CHAT_CHOICES)
def test_chat_forced_call_with_room_is_whole_and_valid(client: openai.OpenAI, choice: Any, name: str | None) -> None:
    done = client.chat.completions.create(model="m", messages=ASK, tools=_chat_tools(SCHEMAS), tool_choice=choice,
                                          parallel_tool_calls=False, max_tokens=ROOM)
    choice_out = done.choices[0]
    [call] = choice_out.message.tool_calls
    assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None
    assert name in (None, call.function.name)
    _valid(call.function.name, json.loads(call.function.arguments))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("choice", "tools"), [
    ("required", {"note": NOTE}),
    ({"type": "function", "function": {"name": "note"}}, {**SCHEMAS, "note": NOTE}),
])
def test_chat_forced_call_cut_by_max_tokens_is_a_call(client: openai.OpenAI, choice: Any, tools: dict[str, Any],
                                                      stream: bool) -> None:
    """`length`, and the call so far in `tool_calls`: no content, the whole budget spent on the call."""
    body: dict[str, Any] = {"model": "m", "messages": ASK, "tools": _chat_tools(tools), "tool_choice": choice,
                            "max_tokens": CUT}
    if stream:
        chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
        assert [d.index for d in deltas] == [0, 0] and deltas[0].function.name == "note"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        _valid_so_far("note", deltas[1].function.arguments)
        return
    done = client.chat.completions.create(**body)
    [call] = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "length" and done.choices[0].message.content is None
    assert call.function.name == "note" and done.usage.completion_tokens == CUT
    _valid_so_far("note", call.function.arguments)


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_call_with_room_is_whole_and_valid(claude: anthropic.Anthropic, choice: Any) -> None:
    tools: Any = [{"name": f["name"], "input_schema": f["parameters"]} for f in FUNCTIONS]
    message = claude.messages.create(model="m", max_tokens=ROOM, messages=ASK, tools=tools, tool_choice=choice)
    [block] = message.content
    assert message.stop_reason == "tool_use" and block.type == "tool_use"
    assert choice["type"] == "any" or block.name == "get_weather"
    _valid(block.name, block.input)


@pytest.mark.parametrize("max_tokens", [1, CUT, 24])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "note"}])
def test_anthropic_forced_call_cut_by_max_tokens_is_a_tool_use(claude: anthropic.Anthropic, choice: Any,
                                                               max_tokens: int) -> None:
    """stop_reason max_tokens and one tool_use (never a text block); streamed, the same block and input."""
    tools: Any = [{"name": "note", "input_schema": NOTE}]
    if choice["type"] == "tool":
        tools += [{"name": f["name"], "input_schema": f["parameters"]} for f in FUNCTIONS]
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "messages": ASK, "tools": tools,
                            "tool_choice": choice}
    message = claude.messages.create(**body)
    [block] = message.content
    assert message.stop_reason == "max_tokens" and block.type == "tool_use" and block.name == "note"
    assert message.usage.output_tokens == max_tokens
    jsonschema.validate(block.input, {**NOTE, "required": []})
    with claude.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "note", block.input)]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_forced_call_with_room_is_whole_and_valid(client: openai.OpenAI, choice: Any) -> None:
    tools: Any = [{"type": "function", **f} for f in FUNCTIONS]
    done = client.responses.create(model="m", input=ASK, tools=tools, tool_choice=choice, parallel_tool_calls=False,
                                   max_output_tokens=ROOM)
    [item] = done.output
    assert done.status == "completed" and item.type == "function_call" and item.status == "completed"
    _valid(item.name, json.loads(item.arguments))


@pytest.mark.parametrize("max_output_tokens", [1, CUT, 48])
def test_responses_forced_call_cut_by_max_tokens_is_an_incomplete_function_call(client: openai.OpenAI,
                                                                                max_output_tokens: int) -> None:
    """The issue's case: one function tool, "required", 48 tokens: an incomplete function_call, no message."""
    body: dict[str, Any] = {"model": "m", "input": ASK, "tools": [{"type": "function", "name": "note",
                                                                   "parameters": NOTE}],
                            "tool_choice": "required", "max_output_tokens": max_output_tokens}
    done = client.responses.create(**body)
    [item] = done.output
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert (item.type, item.name, item.status) == ("function_call", "note", "incomplete")
    _valid_so_far("note", item.arguments)
    # The SDK's get_final_response waits for response.completed only; an incomplete one ends with its own event.
    [streamed] = [e.response for e in client.responses.create(**body, stream=True) if e.type == "response.incomplete"]
    assert [(i.type, i.name, i.status, i.arguments) for i in streamed.output] == [
        ("function_call", "note", "incomplete", item.arguments)]
