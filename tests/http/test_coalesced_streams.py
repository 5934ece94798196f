"""A tool call streamed through coalesced events, on every wire that streams tool calls (issue 20, point 4).

When a stream falls behind, the session relays every waiting token as one
`TextDelta` (`actors/session.py`, `_coalesced`), so one event may carry the
reasoning, the text and a whole tool call at once. Each wire must then say
exactly what it says when the same output arrives a few characters per event.
The scripted engine gives both: 3 characters per delta, or all of it in one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.http.fakes import ScriptedEngine
from tests.http.http_helpers import serve_fake, sse_events

from mlx_trio.output_format import OutputFormat

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = "<think>Hm, weather.</think>Let me look it up." + CALL
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _payloads(text: str) -> list[dict[str, Any]]:
    data = [line.removeprefix("data: ") for event in sse_events(text) for line in event.split("\n")
            if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]


def _chat(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    shown: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in payloads:
        for choice in chunk.get("choices", ()):
            delta = choice["delta"]
            shown["content"] += delta.get("content") or ""
            shown["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls", ()):
                mine = shown["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                mine["name"] += call.get("function", {}).get("name", "")
                mine["arguments"] += call.get("function", {}).get("arguments", "")
            shown["finish"] = choice["finish_reason"] or shown["finish"]
    return shown


def _messages(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    blocks: dict[int, dict[str, Any]] = {}
    stop = None
    for event in payloads:
        if event["type"] == "content_block_start":
            block = event["content_block"]
            blocks[event["index"]] = {"type": block["type"], "name": block.get("name"), "text": ""}
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            blocks[event["index"]]["text"] += delta.get("text") or delta.get("thinking") or delta.get("partial_json", "")
        elif event["type"] == "message_delta":
            stop = event["delta"]["stop_reason"]
    return {"blocks": [blocks[i] for i in sorted(blocks)], "stop": stop}


def _responses(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    done = [event["response"] for event in payloads if event["type"] == "response.completed"]
    assert len(done) == 1
    shown = []
    for item in done[0]["output"]:
        if item["type"] == "function_call":
            shown.append(("call", item["name"], json.loads(item["arguments"])))
        elif item["type"] == "message":
            shown.append(("message", "".join(part["text"] for part in item["content"])))
        else:
            shown.append((item["type"], json.dumps(item.get("content") or item.get("summary"))))
    deltas = "".join(event["delta"] for event in payloads if event["type"] == "response.output_text.delta")
    return {"output": shown, "streamed_text": deltas, "status": done[0]["status"]}


WIRES = {
    "chat": ("/v1/chat/completions", {"messages": ASK, "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]}, _chat),
    "messages": ("/v1/messages", {"messages": ASK, "max_tokens": 200, "tools": [
        {"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMS}]}, _messages),
    "responses": ("/v1/responses", {"input": "Weather in Paris?", "tools": [
        {"type": "function", "name": "get_weather", "parameters": PARAMS}]}, _responses),
}


@pytest.mark.parametrize("wire", list(WIRES))
async def test_a_tool_call_in_one_coalesced_event_streams_as_it_does_piece_by_piece(
        wire: str, tools_format: OutputFormat) -> None:
    path, body, shown = WIRES[wire]
    results = []
    for chars_per_delta in (3, len(SCRIPT)):  # piece by piece; then the whole output as one coalesced delta
        async with serve_fake(ScriptedEngine(tools_format, [SCRIPT], chars_per_delta=chars_per_delta)) as (_, http):
            response = await http.post(path, json={**body, "stream": True})
        assert response.status_code == 200
        results.append(shown(_payloads(response.text)))
    piecewise, coalesced = results
    assert coalesced == piecewise
    if wire == "chat":
        assert coalesced["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        assert coalesced["content"] == "Let me look it up." and coalesced["finish"] == "tool_calls"
    elif wire == "messages":
        assert [b["type"] for b in coalesced["blocks"]] == ["thinking", "text", "tool_use"]
        assert json.loads(coalesced["blocks"][2]["text"]) == {"city": "Paris"} and coalesced["stop"] == "tool_use"
    else:
        assert ("call", "get_weather", {"city": "Paris"}) in coalesced["output"]
        assert coalesced["streamed_text"] == "Let me look it up."
