"""Anthropic tool search (issue #44): `defer_loading` tools, `tool_reference` blocks, the tool search tool types.

The request shapes are Claude Code 2.1.332's (docs/harnesses.md): its own
`ToolSearch` custom tool, a `DeferredToolPlaceholder` with `defer_loading:
true`, and, once the model searched, the found tool added to `tools` (still
deferred) and a `tool_result` holding a `tool_reference` to it. The scripted
engine records what each request hands the engine: the template's tools, the
prompt, the grammar.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.http.fakes import ScriptedEngine
from tests.http.http_helpers import serve_fake

from mlx_trio.output_format import GENERIC, OutputFormat, generic_calls_text

BASH = {"name": "Bash", "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
SEARCH = {"name": "ToolSearch", "description": "Load deferred tools",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
PLACEHOLDER = {"name": "DeferredToolPlaceholder", "description": "never call this tool",
               "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
WEATHER = {"name": "get_weather", "description": "Weather in a city", "defer_loading": True,
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}
SEARCH_USE = {"type": "tool_use", "id": "toolu_search", "name": "ToolSearch", "input": {"query": "select:get_weather"}}
LOADED = {"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": "toolu_search",
     "content": [{"type": "tool_reference", "tool_name": "get_weather"}]},
    {"type": "text", "text": "Tool loaded."}]}
# The tool message a tool_reference to get_weather renders as: its definition, as ToolSearch's description says.
WEATHER_FUNCTIONS = ('<functions>\n<function>{"description": "Weather in a city", "name": "get_weather", "parameters": '
                     + json.dumps(WEATHER["input_schema"]) + "}</function>\n</functions>")


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool["name"], "parameters": tool["input_schema"],
                                             "description": tool["description"]}}


def _call(fmt: OutputFormat, name: str, arguments: dict[str, Any]) -> str:
    if fmt is GENERIC:
        return generic_calls_text([{"name": name, "arguments": arguments}])
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def _post(engine: ScriptedEngine, *bodies: dict[str, Any]) -> list[Any]:
    async with serve_fake(engine) as (_, http):
        return [await http.post("/v1/messages", json={"model": "m", "max_tokens": 64, **body}) for body in bodies]


@pytest.fixture(params=["native", "generic"])
def fmt(request: pytest.FixtureRequest, tools_format: OutputFormat) -> OutputFormat:
    return tools_format if request.param == "native" else GENERIC


async def test_a_tool_reference_loads_a_deferred_tool_without_changing_the_prompt_before_it(fmt: OutputFormat) -> None:
    """Claude Code's search turn: the deferred tools stay out of the template's tool list on both turns (the
    same list, so the first prompt is a prefix of the second); the reference renders as the tool's definition
    in the tool message, and the model may then call the tool (the generic grammar lets it name it)."""
    engine = ScriptedEngine(fmt, [_call(fmt, "ToolSearch", SEARCH_USE["input"]),
                                  _call(fmt, "get_weather", {"city": "Paris"})])
    first, second = await _post(
        engine,
        {"tools": [BASH, SEARCH, PLACEHOLDER], "messages": [ASK]},
        # Claude Code adds the found tool to `tools`, still deferred, in the middle of the list.
        {"tools": [BASH, SEARCH, WEATHER, PLACEHOLDER],
         "messages": [ASK, {"role": "assistant", "content": [SEARCH_USE]}, LOADED]})
    assert first.status_code == 200, first.text
    assert second.status_code == 200, second.text
    assert [(b["type"], b["name"]) for b in first.json()["content"]] == [("tool_use", "ToolSearch")]
    call = second.json()["content"]
    assert [(b["type"], b["name"], b["input"]) for b in call] == [("tool_use", "get_weather", {"city": "Paris"})]
    (prompt1, kwargs1), (prompt2, kwargs2) = engine.prepared
    assert kwargs1["tools"] == kwargs2["tools"] == [_function(BASH), _function(SEARCH)]
    assert prompt2[:len(prompt1)] == prompt1
    assert prompt2[len(prompt1):] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_search", "type": "function",
             "function": {"name": "ToolSearch", "arguments": SEARCH_USE["input"]}}]},
        {"role": "tool", "tool_call_id": "toolu_search", "content": WEATHER_FUNCTIONS},
        {"role": "user", "content": "Tool loaded."}]
    if fmt is GENERIC:  # the grammar holds the names a call may take: the shown tools, then the loaded one
        assert "get_weather" not in kwargs1["constraint"].source
        assert "get_weather" in kwargs2["constraint"].source
        assert "DeferredToolPlaceholder" not in kwargs2["constraint"].source


async def test_a_tool_result_mixes_text_and_references(tools_format: OutputFormat) -> None:
    """Text blocks stay text; each run of references is one `<functions>` block; a shown tool may be referenced."""
    mixed = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_search", "content": [
        {"type": "text", "text": "Found:"}, {"type": "tool_reference", "tool_name": "get_weather"},
        {"type": "tool_reference", "tool_name": "Bash"}]}]}
    engine = ScriptedEngine(tools_format, ["ok"])
    [response] = await _post(engine, {"tools": [BASH, SEARCH, WEATHER],
                                      "messages": [ASK, {"role": "assistant", "content": [SEARCH_USE]}, mixed]})
    assert response.status_code == 200, response.text
    bash = json.dumps({"description": BASH["description"], "name": "Bash", "parameters": BASH["input_schema"]})
    assert engine.prepared[0][0][-1]["content"] == (
        "Found:\n" + WEATHER_FUNCTIONS.removesuffix("\n</functions>") + f"\n<function>{bash}</function>\n</functions>")


async def test_with_a_server_tool_search_tool_the_deferred_tools_are_shown_up_front(tools_format: OutputFormat) -> None:
    """This server runs no search step: the deferred tools are shown in request order (the same list on every
    request), the search tool is not, and its blocks replayed in the history are accepted and dropped."""
    search_tool = {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}
    replayed = {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "tool_search_tool_regex",
         "input": {"pattern": "weather"}},
        {"type": "tool_search_tool_result", "tool_use_id": "srvtoolu_1", "content": {
            "type": "tool_search_tool_search_result",
            "tool_references": [{"type": "tool_reference", "tool_name": "get_weather"}]}},
        {"type": "text", "text": "Found it."}]}
    engine = ScriptedEngine(tools_format, ["ok", "ok"])
    responses = await _post(engine, {"tools": [search_tool, WEATHER, BASH], "messages": [ASK]},
                            {"tools": [search_tool, WEATHER, BASH], "messages": [ASK, replayed, ASK]})
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert [kwargs["tools"] for _, kwargs in engine.prepared] == [[_function(WEATHER), _function(BASH)]] * 2
    assert engine.prepared[1][0][1] == {"role": "assistant", "content": "Found it."}


def _reference_to(name: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_search",
                                         "content": [{"type": "tool_reference", "tool_name": name}]}]}


SEARCHED = [ASK, {"role": "assistant", "content": [SEARCH_USE]}]


@pytest.mark.parametrize(("body", "field"), [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [BASH, {"type": "tool_search_tool_regex_20990101", "name": "s"}]}, "tools[1].type"),
    ({"tools": [BASH, {**WEATHER, "defer_loading": "yes"}]}, "tools[1].defer_loading"),
    ({"tools": [BASH, {"type": "tool_search_tool_bm25_20251119", "name": "s", "defer_loading": True}]},
     "tools[1].defer_loading"),
    ({"tools": [WEATHER, PLACEHOLDER]}, "tools"),
    ({"tools": [BASH, SEARCH, WEATHER], "messages": [*SEARCHED, _reference_to("nope")]},
     "messages[2].content[0].content[0].tool_name"),
    ({"tools": [BASH, SEARCH], "messages": [*SEARCHED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_search", "content": [{"type": "fancy"}]}]}]},
     "messages[2].content[0].content[0].type"),
    ({"tools": [BASH], "messages": [{"role": "user", "content": [{"type": "tool_reference", "tool_name": "Bash"}]}]},
     "messages[0].content[0].type"),
    ({"tools": [BASH], "messages": [{"role": "user", "content": [{"type": "fancy"}]}]}, "messages[0].content[0].type"),
    ({"tools": [BASH], "messages": [ASK, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "tool_search_tool_regex", "input": {}}]}]},
     "messages[1].content[0].type"),
])
async def test_unknown_tools_and_blocks_are_anthropic_400s_naming_the_field(tools_format: OutputFormat,
                                                                          body: dict[str, Any], field: str) -> None:
    """Never a 500 or a hang: an Anthropic-shaped 400 whose message starts with the field's path."""
    [response] = await _post(ScriptedEngine(tools_format, []), {"messages": [ASK], **body})
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"].startswith(f"{field}: "), payload["error"]["message"]
