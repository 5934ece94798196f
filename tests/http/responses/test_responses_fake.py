"""POST /v1/responses and the stored-response routes through the official `openai` SDK, on a scripted engine.

The scripted engine answers with fixed text cut in small deltas, through a
real model's output format (the QWEN3_TOOLS tiny model's `<think>` and
`<tool_call>` markers), so these check the wire: items → prompt, pieces →
items and events, store and errors. The real engine is in
test_responses_live.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import trio
from tests.http.fakes import FakeEngine, ScriptedEngine
from tests.http.http_helpers import assert_openai_error, serve_fake, sse_events
from tests.http.responses.sdk_checks import valid_events, valid_response

from mlx_trio.errors import EngineDown, EngineFailure, Overloaded
from mlx_trio.http.responses.store import LocalResponses, ResponseStore, StoredResponse
from mlx_trio.output_format import OutputFormat
from mlx_trio.params import Constraint

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TEMPLATE_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                     "parameters": WEATHER["parameters"]}}
PATCH_GRAMMAR = 'start: "*** Begin Patch\\n" LINE* "*** End Patch"\nLINE: /[^*\\n][^\\n]*\\n/\n'
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@asynccontextmanager
async def sdk(engine: FakeEngine, **config: Any) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    async with serve_fake(engine, **config) as (server, http):
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            yield client, http


async def test_create_builds_the_prompt_and_sampling_from_the_body(tools_format: OutputFormat) -> None:
    """instructions and developer text become one system turn; Responses field names become sampling fields."""
    engine = ScriptedEngine(tools_format, ["Hello there."])
    async with sdk(engine) as (client, _):
        response = await client.responses.create(
            model="m", instructions="Be brief.", max_output_tokens=50, temperature=0.5, top_p=0.9,
            input=[{"role": "developer", "content": "Use metric units."},
                   {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            metadata={"k": "v"}, prompt_cache_key="thread-1", include=["reasoning.encrypted_content"],
            reasoning={"effort": "low"}, extra_body={"seed": 7, "top_k": 5})
    valid_response(response.model_dump())
    assert response.status == "completed" and response.output_text == "Hello there."
    assert response.id.startswith("resp_") and response.metadata == {"k": "v"}
    assert response.instructions == "Be brief." and response.max_output_tokens == 50
    assert response.usage is not None and response.usage.output_tokens == len("Hello there.")
    prompt, kwargs = engine.prepared[0]
    assert prompt == [{"role": "system", "content": "Be brief.\n\nUse metric units."},
                      {"role": "user", "content": "Hi"}]
    assert {k: kwargs[k] for k in ("max_tokens", "temperature", "top_p", "seed", "top_k")} == {
        "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "seed": 7, "top_k": 5}
    assert kwargs["tools"] is None


async def test_stream_events_are_typed_numbered_and_end_with_the_whole_response(tools_format: OutputFormat) -> None:
    """Raw SSE: `event:` names the `type`, sequence numbers count up, no [DONE]; the SDK accumulator agrees."""
    engine = ScriptedEngine(tools_format, ["<think>hmm</think>Hello.", "<think>hmm</think>Hello."])
    async with sdk(engine) as (client, http):
        raw = await http.post("/v1/responses", json={"input": "Hi", "stream": True})
        async with client.responses.stream(model="m", input="Hi") as stream:
            final = await stream.get_final_response()
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in sse_events(raw.text) if not f.startswith(":")]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {events[-1]['type']}"
    valid_events(events)
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed"
    assert [(i["type"], i["status"]) for i in events[-1]["response"]["output"]] == [("reasoning", "completed"),
                                                                                    ("message", "completed")]
    assert final.output_text == "Hello." and final.output[0].type == "reasoning"
    assert final.output[0].content is not None and final.output[0].content[0].text == "hmm"


async def test_function_tool_round_trip(tools_format: OutputFormat) -> None:
    """function_call → function_call_output → text: the history reaches the template as tool_calls and a tool turn."""
    engine = ScriptedEngine(tools_format, [CALL, "Sunny in Paris."])
    async with sdk(engine) as (client, _):
        first = await client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER])
        call = first.output[0]
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
        history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
        second = await client.responses.create(model="m", input=history, tools=[WEATHER])
    assert second.output_text == "Sunny in Paris."
    assert engine.prepared[0][1]["tools"] == [TEMPLATE_WEATHER]
    assert engine.prepared[1][0] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]


async def test_codex_tool_kinds_namespaces_and_web_search(tools_format: OutputFormat) -> None:
    """As Codex sends them: a namespace's tools are offered flat and their calls name it; web_search is left out."""
    engine = ScriptedEngine(tools_format, [CALL])
    async with sdk(engine) as (_, http):
        response = await http.post("/v1/responses", json={"input": "Weather?", "tools": [
            {"type": "web_search", "external_web_access": False},
            {"type": "namespace", "name": "weather_v1", "description": "Weather tools", "tools": [WEATHER]}]})
    item = valid_response(response.json()).output[0]
    assert item.type == "function_call" and item.name == "get_weather" and item.namespace == "weather_v1"
    assert engine.prepared[0][1]["tools"] == [TEMPLATE_WEATHER]


async def test_previous_response_id_continues_the_stored_conversation(tools_format: OutputFormat) -> None:
    """The second prompt is the first turn, its answer and the new input; input_items lists this turn's items."""
    engine = ScriptedEngine(tools_format, [CALL, "Sunny."])
    async with sdk(engine) as (client, _):
        first = await client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER])
        call = first.output[0]
        assert call.type == "function_call"
        second = await client.responses.create(
            model="m", previous_response_id=first.id, tools=[WEATHER],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        items = await client.responses.input_items.list(second.id)
        fetched = await client.responses.retrieve(second.id)
    assert second.previous_response_id == first.id and second.output_text == "Sunny."
    assert [m["role"] for m in engine.prepared[1][0]] == ["user", "assistant", "tool"]
    assert [(i.type, i.id is not None) for i in items.data] == [("function_call_output", True)]
    assert items.first_id == items.last_id == items.data[0].id and not items.has_more
    assert fetched.model_dump() == second.model_dump()


async def test_get_delete_and_unknown_ids(tools_format: OutputFormat) -> None:
    engine = ScriptedEngine(tools_format, ["One.", "Two."])
    async with sdk(engine) as (client, http):
        stored = await client.responses.create(model="m", input=[
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
        unstored = await client.responses.create(model="m", input="Hi", store=False)
        newest_first = await client.responses.input_items.list(stored.id, limit=2)
        oldest_first = await client.responses.input_items.list(stored.id, order="asc", after=newest_first.data[-1].id)
        assert [i.content[0].text for i in newest_first.data] == ["c", "b"] and newest_first.has_more
        assert [i.content[0].text for i in oldest_first.data] == ["c"]
        for path in (f"/v1/responses/{unstored.id}", "/v1/responses/resp_nope", "/v1/responses/resp_nope/input_items"):
            assert_openai_error(await http.get(path), 404, code="not_found", param="response_id")
        deleted = await http.delete(f"/v1/responses/{stored.id}")
        assert deleted.json() == {"id": stored.id, "object": "response.deleted", "deleted": True}
        assert_openai_error(await http.get(f"/v1/responses/{stored.id}"), 404)
        assert_openai_error(await http.delete(f"/v1/responses/{stored.id}"), 404)
        again = await http.post("/v1/responses", json={"input": "x", "previous_response_id": stored.id})
        assert_openai_error(again, 404, code="previous_response_not_found", param="previous_response_id")
    assert len(engine.prepared) == 2  # the unknown previous_response_id never reached the engine


async def test_a_zero_byte_store_keeps_nothing(tools_format: OutputFormat) -> None:
    async with sdk(ScriptedEngine(tools_format, ["One."]), responses_store_bytes=0) as (client, http):
        response = await client.responses.create(model="m", input="Hi")
        assert_openai_error(await http.get(f"/v1/responses/{response.id}"), 404)


class _SharedStore(LocalResponses):
    """An engine's `responses_store`, as a front process's `RemoteEngine` has; `fail_puts` makes a put fail."""

    def __init__(self) -> None:
        super().__init__(ResponseStore(1 << 20))
        self.fail_puts = False

    async def put(self, entry: StoredResponse) -> bool:
        await trio.lowlevel.checkpoint()
        if self.fail_puts:
            raise EngineDown("the engine link broke; retry", retry_after_s=1.0)
        return await super().put(entry)


async def test_an_engine_with_a_responses_store_is_served_from_it(tools_format: OutputFormat) -> None:
    """Two apps on one engine that has a store (two fronts): a response made through one continues on the other."""
    engine = ScriptedEngine(tools_format, ["One.", "Two."])
    engine.responses_store = _SharedStore()  # type: ignore[attr-defined]
    async with sdk(engine) as (client, _), sdk(engine) as (other, _):
        first = await client.responses.create(model="m", input="Hi")
        second = await other.responses.create(model="m", input="More", previous_response_id=first.id)
        fetched = await client.responses.retrieve(second.id)
    assert fetched.model_dump() == second.model_dump()
    assert [m["content"] for m in engine.prepared[1][0]] == ["Hi", "One.", "More"]
    assert set(engine.responses_store.store._entries) == {first.id, second.id}  # type: ignore[attr-defined]


async def test_the_put_is_done_before_the_response_ends(tools_format: OutputFormat) -> None:
    """The store's put is awaited before the last frame: a put that fails is the stream's error, not a
    `response.completed` the client would continue from in vain (non-streamed: a 503)."""
    engine = ScriptedEngine(tools_format, ["One.", "Two.", "Three."])
    store = engine.responses_store = _SharedStore()  # type: ignore[attr-defined]
    store.fail_puts = True
    async with sdk(engine) as (_, http):
        raw = await http.post("/v1/responses", json={"input": "hi", "stream": True})
        whole = await http.post("/v1/responses", json={"input": "hi"})
        unstored = await http.post("/v1/responses", json={"input": "hi", "store": False})
    events = [json.loads(f.split("\ndata: ")[1]) for f in sse_events(raw.text) if not f.startswith(":")]
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "engine_down"
    assert "response.completed" not in [e["type"] for e in events]
    assert_openai_error(whole, 503, code="engine_down")
    assert unstored.status_code == 200 and unstored.json()["status"] == "completed"  # nothing to put


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": [{"type": "telepathy", "text": "hi"}]}, "input[0].type", "unknown item type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "4"}]}, "input[0].call_id",
     "no earlier function_call"),
    ({"input": 5}, "input", "string or a list"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "must be one of"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0].type", "images and files are not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]},
     "input[0].arguments", "JSON text"),
    ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens", "integer"),
    ({"input": "hi", "temperature": "hot"}, "temperature", "number"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools[0].type", "'file_search' tools are not supported"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name",
     "must name one of the tools"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "JSON schema"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type", "must be"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": "hi", "store": "yes"}, "store", "boolean"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "ebnf",
                                                                          "definition": "x"}}]},
     "tools[0].format.syntax", "lark"),
])
async def test_bad_input_is_a_400_naming_the_field(tools_format: OutputFormat, body: dict[str, Any], param: str,
                                                   says: str) -> None:
    engine = ScriptedEngine(tools_format, ["unused"])
    async with sdk(engine) as (_, http):
        error = assert_openai_error(await http.post("/v1/responses", json=body), 400, param=param)
        assert says in error["message"]
        # The server is still well: the next request is answered.
        assert (await http.post("/v1/responses", json={"input": "hi"})).status_code == 200


async def test_tools_on_a_model_without_a_tool_format_are_refused() -> None:
    async with sdk(FakeEngine()) as (_, http):
        response = await http.post("/v1/responses", json={"input": "hi", "tools": [WEATHER]})
    assert_openai_error(response, 400, param="tools")


async def test_text_format_json_schema_becomes_the_grammar(tools_format: OutputFormat) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine = ScriptedEngine(tools_format, ['{"a": 1}'])
    async with sdk(engine) as (client, _):
        response = await client.responses.create(model="m", input="Give a.", text={
            "format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}})
    assert json.loads(response.output_text) == {"a": 1}
    assert engine.prepared[0][1]["constraint"] == Constraint("json_schema", json.dumps(schema))


async def test_a_custom_tool_called_in_auto_mode(tools_format: OutputFormat) -> None:
    """The template sees the custom tool as a function of one string `input`; the call comes back as its input."""
    patch = "*** Begin Patch\n+x\n*** End Patch"
    script = '<tool_call>\n' + json.dumps({"name": "apply_patch", "arguments": {"input": patch}}) + '\n</tool_call>'
    engine = ScriptedEngine(tools_format, [script, "Done."])
    async with sdk(engine) as (client, _):
        first = await client.responses.create(model="m", input="Patch it", tools=[APPLY_PATCH, WEATHER])
        call = first.output[0]
        assert call.type == "custom_tool_call" and call.input == patch and call.name == "apply_patch"
        second = await client.responses.create(model="m", tools=[APPLY_PATCH, WEATHER], input=[
            {"role": "user", "content": "Patch it"}, call.model_dump(exclude_none=True),
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "applied"}])
    assert second.output_text == "Done."
    tools = engine.prepared[0][1]["tools"]
    assert tools[0] == {"type": "function", "function": {
        "name": "apply_patch", "description": "Edit files",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}
    assert "constraint" not in engine.prepared[0][1]
    assert engine.prepared[1][0][1]["tool_calls"][0]["function"] == {"name": "apply_patch",
                                                                    "arguments": {"input": patch}}


@pytest.mark.parametrize("tool_choice", [{"type": "custom", "name": "apply_patch"}, "required"])
async def test_a_forced_custom_tool_answers_in_its_grammar(tools_format: OutputFormat, tool_choice: Any) -> None:
    """Forced, the custom tool's lark grammar constrains the whole answer, which is the call's input."""
    patch = "*** Begin Patch\n+x\n*** End Patch"
    engine = ScriptedEngine(tools_format, [patch])
    tools = [APPLY_PATCH] if tool_choice == "required" else [APPLY_PATCH, WEATHER]
    async with sdk(engine) as (client, http):
        async with client.responses.stream(model="m", input="Patch it", tools=tools,  # type: ignore[arg-type]
                                           tool_choice=tool_choice) as stream:
            final = await stream.get_final_response()
        with_format = await http.post("/v1/responses", json={
            "input": "x", "tools": tools, "tool_choice": tool_choice, "text": {"format": {"type": "json_object"}}})
    call = final.output[0]
    assert len(final.output) == 1 and call.type == "custom_tool_call" and call.input == patch
    assert engine.prepared[0][1]["constraint"] == Constraint("lark", PATCH_GRAMMAR)
    assert_openai_error(with_format, 400, param="text.format")


async def test_a_fault_after_the_headers_ends_the_stream_with_response_failed() -> None:
    engine = FakeEngine()
    engine.fail_with = EngineFailure("the decoder died")
    async with sdk(engine) as (_, http):
        raw = await http.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 4})
        engine.fail_with = None
        engine.fail_before_start = Overloaded("the queue is full", retry_after_s=2)
        full = await http.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 4})
    frames = sse_events(raw.text)
    assert ": keepalive 0/1" in frames  # prefill progress keeps the connection alive
    events = [json.loads(f.split("\ndata: ")[1]) for f in frames if not f.startswith(":")]
    valid_events(events)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "the decoder died"}
    assert_openai_error(full, 503, code="overloaded")
    assert full.headers["retry-after"] == "2"


async def test_max_output_tokens_ends_incomplete_and_logprobs_come_when_asked() -> None:
    engine = FakeEngine()
    async with sdk(engine) as (client, _):
        response = await client.responses.create(model="m", input="hi", max_output_tokens=3, top_logprobs=2,
                                                 include=["message.output_text.logprobs"])
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == "w0 w1 w2 "
    assert engine.prepared[0][1]["logprobs"] is True and engine.prepared[0][1]["top_logprobs"] == 2


async def test_compact_gives_the_history_back(tools_format: OutputFormat) -> None:
    async with sdk(ScriptedEngine(tools_format, [])) as (_, http):
        items = [{"role": "user", "content": "a"}, {"type": "message", "role": "assistant",
                                                    "content": [{"type": "output_text", "text": "b"}]}]
        compacted = (await http.post("/v1/responses/compact", json={"model": "m", "input": items})).json()
        bad = await http.post("/v1/responses/compact", json={"input": [{"type": "nope"}]})
    assert compacted["object"] == "response.compaction"
    assert [(i["type"], i["role"]) for i in compacted["output"]] == [("message", "user"), ("message", "assistant")]
    assert_openai_error(bad, 400, param="input[0].type")
