"""The generic tool format through the real engine, on the tiny Llama (ChatML, no tool format of its own).

A random-weight model only calls a tool when the grammar makes it (tool_choice
"required" / named / Anthropic "any" / "tool"), so the forced cases check the
calls against the tools' schemas, the "auto" case accepts text or a valid call,
and the prompts are compared token for token with the template applied to the
chat that `generic_chat` writes.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from mlx_lm.tokenizer_utils import load
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, tiny_engine_config
from tests.http.test_live import _decode_counts

from mlx_trio.engine.model.generic_tools import generic_chat
from mlx_trio.http import ServerConfig
from mlx_trio.testing import LLAMA, tiny_model

# A random-weight model never closes a free string: arguments are enums and small integers.
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
SCHEMAS = {"get_weather": CITY, "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(tiny_engine_config(max_tokens=64), ServerConfig(port=0)) as thread:
        yield thread


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load(tiny_model(LLAMA))


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


def _valid(name: str, arguments: Any) -> None:
    """A call names a declared tool and its arguments validate against that tool's schema."""
    assert name in SCHEMAS
    jsonschema.validate(arguments, SCHEMAS[name])


def _prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    return len(tokenizer.apply_chat_template(generic_chat(messages, tools), add_generation_prompt=True))


def test_the_prompt_is_the_template_over_the_generic_chat(client: openai.OpenAI, tokenizer: Any) -> None:
    """The tools and the instruction reach the model as a system message the plain ChatML template renders."""
    done = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=1)
    assert done.usage.prompt_tokens == _prompt_tokens(tokenizer, ASK, [WEATHER])
    rendered = tokenizer.apply_chat_template(generic_chat(ASK, [WEATHER]), add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou can use these tools:\n{\"name\": \"get_weather\"")
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=1)
    assert plain.usage.prompt_tokens == len(tokenizer.apply_chat_template(ASK, add_generation_prompt=True))


@pytest.mark.parametrize("parallel", [True, False])
def test_required_forces_valid_calls(client: openai.OpenAI, parallel: bool) -> None:
    """tool_choice required: only calls, each to a declared tool with arguments valid against its schema."""
    done = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          parallel_tool_calls=parallel, max_tokens=200)
    choice = done.choices[0]
    calls = choice.message.tool_calls
    assert choice.message.content is None
    if parallel:  # a random-weight model left free chains calls up to max_tokens; the last one is cut
        assert choice.finish_reason == "length" and len(calls) > 1
        calls = calls[:-1]
    else:
        assert choice.finish_reason == "tool_calls" and len(calls) == 1
    for call in calls:
        _valid(call.function.name, json.loads(call.function.arguments))


def test_a_named_function_is_called_once(client: openai.OpenAI) -> None:
    """A named function: exactly one call, of that function."""
    done = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=200,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _valid(call.function.name, json.loads(call.function.arguments))


@pytest.mark.parametrize("seed", range(4))
def test_auto_answers_in_text_or_a_valid_call(client: openai.OpenAI, seed: int) -> None:
    """tool_choice auto: whatever the model samples is text (never a broken call) or calls that validate."""
    done = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=24,
                                          temperature=1.0, seed=seed)
    message, finish = done.choices[0].message, done.choices[0].finish_reason
    if message.tool_calls:
        assert finish in ("tool_calls", "length")
        for call in message.tool_calls[:-1] if finish == "length" else message.tool_calls:  # the last may be cut
            _valid(call.function.name, json.loads(call.function.arguments))
    elif message.content is None:  # cut before the call's name was written
        assert finish == "length"
    else:
        assert not message.content.lstrip().startswith("{")


def test_streamed_calls_are_the_non_streamed_ones_and_come_one_by_one(client: openai.OpenAI) -> None:
    """Streaming: each call is an id+name chunk then its arguments, sent once its object closes, before the next.

    Greedy, the stream equals the whole answer: the same calls, the one cut by
    max_tokens included (sent at the end, as far as it was written).
    """
    body: dict[str, Any] = {"model": "m", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
                            "max_tokens": 200}
    whole = client.chat.completions.create(**body).choices[0]
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    deltas = [(n, tc) for n, c in enumerate(chunks) for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name) for _, d in deltas[::2]] == [
        (i, c.function.name) for i, c in enumerate(whole.message.tool_calls)]
    assert [d.function.arguments for _, d in deltas[1::2]] == [c.function.arguments for c in whole.message.tool_calls]
    assert whole.message.content is None and not "".join(c.choices[0].delta.content or "" for c in chunks)
    # Call i+1 came in a later text delta than call i: calls stream as they close, not all at the end.
    firsts = [n for n, _ in deltas[::2]]
    assert len(firsts) > 1 and firsts == sorted(set(firsts))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_round_trip(client: openai.OpenAI, tokenizer: Any) -> None:
    """Call, tool result, answer: the history reaches the model as its own call JSON and a user turn."""
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200)
    [call] = first.choices[0].message.tool_calls
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=8,
                                            tool_choice="none")
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    template_history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}, history[2]]
    # tool_choice none: no tools in the system prompt, but the history is still the generic format's.
    assert second.usage.prompt_tokens == _prompt_tokens(tokenizer, template_history, None)
    rendered = tokenizer.apply_chat_template(generic_chat(template_history, None), tokenize=False)
    assert f'<|im_start|>assistant\n{{"tool_calls":[{{"name":"get_weather","arguments":{call.function.arguments}' \
        .replace('": ', '":').replace(", ", ",") in rendered
    assert "<|im_start|>user\nTool result from get_weather:\nsunny, 21 C<|im_end|>" in rendered


def test_anthropic_round_trip(claude: anthropic.Anthropic) -> None:
    """tool_choice any makes a tool_use valid against input_schema; streamed, it is the same; then a text answer."""
    tools: list[Any] = [{"name": "get_weather", "input_schema": CITY}, {"name": "get_time",
                                                                        "input_schema": SCHEMAS["get_time"]}]
    first = claude.messages.create(model="m", max_tokens=200, messages=ASK, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    [tool_use] = [b for b in first.content if b.type == "tool_use"]
    _valid(tool_use.name, tool_use.input)
    with claude.messages.stream(model="m", max_tokens=200, messages=ASK, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", tool_use.name, tool_use.input)]
    history: list[Any] = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                        "content": "sunny"}]}]
    second = claude.messages.create(model="m", max_tokens=100, messages=history, tools=tools,
                                    tool_choice={"type": "tool", "name": "get_time"})
    assert second.stop_reason == "tool_use" and [b.name for b in second.content] == ["get_time"]
    third = claude.messages.create(model="m", max_tokens=8, messages=history, tools=tools,
                                   tool_choice={"type": "none"})
    assert third.content[0].type == "text" and third.stop_reason in ("end_turn", "max_tokens")


def test_responses_round_trip(client: openai.OpenAI) -> None:
    """Responses: a forced function_call valid against its schema, streamed the same; its output answered in text."""
    tools: list[Any] = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    first = client.responses.create(model="m", input=ASK, tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200)
    [call] = [item for item in first.output if item.type == "function_call"]
    _valid(call.name, json.loads(call.arguments))
    with client.responses.stream(model="m", input=ASK, tools=tools, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == [(call.name, call.arguments)]
    history: list[Any] = [*ASK, call.model_dump(exclude_none=True),
                          {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model="m", input=history, tools=tools, tool_choice="none", max_output_tokens=8)
    assert [item.type for item in second.output] == ["message"] and second.output_text


def test_four_concurrent_tool_requests_share_decode_steps(server: ServerThread, http: httpx.Client) -> None:
    """Four forced-call requests at once are rows of one batch: fewer steps than tokens, each call valid."""
    start = threading.Barrier(4)

    def ask(city: str) -> list[dict[str, Any]]:
        body = {"messages": [{"role": "user", "content": f"Weather in {city}?"}], "tools": [WEATHER, TIME],
                "tool_choice": "required", "max_tokens": 200}
        with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as one:
            start.wait()
            response = one.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["tool_calls"]

    steps, tokens = _decode_counts(http)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, ["Paris", "Oslo", "Rome", "Lima"]))
    steps_after, tokens_after = _decode_counts(http)
    for calls in answers:
        assert calls
        for call in calls[:-1]:  # the last one may be cut by max_tokens
            _valid(call["function"]["name"], json.loads(call["function"]["arguments"]))
    assert tokens_after - tokens > 2 * (steps_after - steps)


BAD_SCHEMA = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_the_tool(http: httpx.Client, choice: str) -> None:
    """A tool whose parameters use a keyword the grammar engine lacks: 400 naming that tool's parameters."""
    response = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, BAD_SCHEMA],
                                                       "tool_choice": choice})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools[1].function.parameters"
    assert "uniqueItems" in error["message"] and "%json" not in error["message"] and "start:" not in error["message"]


def test_anthropic_bad_schema_and_unknown_history_tool_are_400s(http: httpx.Client) -> None:
    """On /v1/messages too: an unenforceable input_schema (named as Anthropic spells it) and an undeclared tool_use."""
    bad = http.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": ASK, "tools": [
        {"name": "get_weather", "input_schema": CITY}, {"name": "tag", "input_schema": BAD_SCHEMA["function"]["parameters"]}]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    message = bad.json()["error"]["message"]
    assert message.startswith("tools[1].input_schema: ") and "uniqueItems" in message, message
    assert "function" not in message
    history = [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "nope", "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]
    unknown = http.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": history,
                                              "tools": [{"name": "get_weather", "input_schema": CITY}]})
    assert unknown.status_code == 400 and "'nope'" in unknown.json()["error"]["message"]


def test_responses_bad_schema_names_the_flat_parameters_field(http: httpx.Client) -> None:
    """On /v1/responses: the flat tool's `parameters`, counted in the body's own tools (ignored web_search included)."""
    flat = {"type": "function", **BAD_SCHEMA["function"]}
    response = http.post("/v1/responses", json={"input": "Weather in Paris?", "max_output_tokens": 4,
                                                "tools": [{"type": "web_search"}, flat]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools[1].parameters"


def test_an_unknown_tool_in_the_history_is_a_400_naming_the_call(http: httpx.Client) -> None:
    """An assistant call to a tool that is not in tools: 400 naming that call's function name."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "nope", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    response = http.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[1].tool_calls[0].function.name"
    assert "'nope'" in response.json()["error"]["message"]
