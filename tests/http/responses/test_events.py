"""The Responses renderer: router pieces → items and events in the reference's order, valid as the SDK types them."""

from __future__ import annotations

import json

from tests.http.responses.sdk_checks import valid_events, valid_response

from mlx_trio.events import Finished, Usage
from mlx_trio.http.completion.output_router import Content, Reasoning, ToolCall, ToolCallMade
from mlx_trio.http.responses.events import ResponseEvents
from mlx_trio.http.responses.objects import ResponseShape
from mlx_trio.http.server.errors import ApiError
from mlx_trio.logprobs import TokenLogprob

ECHO = {"instructions": None, "metadata": {}, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "temperature": None, "top_p": None}
DONE = Finished("stop", Usage(7, 5, cached_tokens=3))


def _renderer(**kwargs: object) -> ResponseEvents:
    return ResponseEvents(ResponseShape(model="m", echo=ECHO), **kwargs)  # type: ignore[arg-type]


def test_a_text_answer_is_one_message_with_the_reference_events() -> None:
    renderer = _renderer()
    events = [*renderer.start(), *renderer.pieces([Content("Hel")]), *renderer.pieces([Content("lo")]),
              *renderer.finish(DONE)]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    valid_events(events)
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"
    assert [e["delta"] for e in events[4:6]] == ["Hel", "lo"]
    assert events[6]["text"] == "Hello" and events[7]["part"]["text"] == "Hello"
    item = events[8]["item"]
    assert item["status"] == "completed" and item["content"][0]["text"] == "Hello"
    completed = valid_response(events[-1]["response"])
    assert completed.status == "completed" and completed.output_text == "Hello"
    assert completed.usage is not None and completed.usage.model_dump() == {
        "input_tokens": 7, "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0,
                                                    "cache_write_tokens_details": None},
        "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    assert {e["item_id"] for e in events[3:8]} == {item["id"]}


def test_reasoning_then_text_then_a_call_are_three_items_in_order() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    renderer = _renderer()
    events = [*renderer.start(), *renderer.pieces([Reasoning("think")]), *renderer.pieces([Content("ok")]),
              *renderer.pieces([ToolCallMade(0, call)]), *renderer.finish(DONE)]
    valid_events(events)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    response = valid_response(events[-1]["response"])
    reasoning, message, function_call = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "think" and reasoning.summary == []
    assert message.type == "message" and response.output_text == "ok"
    assert function_call.type == "function_call" and function_call.call_id == "call_1"
    assert json.loads(function_call.arguments) == {"city": "Paris"} and function_call.status == "completed"


def test_a_call_of_a_custom_tool_is_a_custom_tool_call_with_its_input() -> None:
    call = ToolCall("call_2", "apply_patch", json.dumps({"input": "*** Begin Patch\n*** End Patch\n"}))
    renderer = _renderer(custom_tools={"apply_patch"})
    events = [*renderer.start(), *renderer.pieces([ToolCallMade(0, call)]), *renderer.finish(DONE)]
    valid_events(events)
    assert [e["type"] for e in events[2:-1]] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done"]
    item = valid_response(events[-1]["response"]).output[0]
    assert item.type == "custom_tool_call" and item.input == "*** Begin Patch\n*** End Patch\n"
    assert item.call_id == "call_2" and item.name == "apply_patch"


def test_max_output_tokens_ends_incomplete_and_a_fault_ends_failed() -> None:
    renderer = _renderer()
    events = [*renderer.start(), *renderer.pieces([Content("a")]), *renderer.finish(Finished("length", Usage(3, 1)))]
    valid_events(events)
    assert events[-1]["type"] == "response.incomplete"
    incomplete = valid_response(events[-1]["response"])
    assert incomplete.status == "incomplete" and incomplete.incomplete_details is not None
    assert incomplete.incomplete_details.reason == "max_output_tokens" and incomplete.output_text == "a"
    # The message max_output_tokens cut is itself incomplete (it said "completed" before, issue #44, 3).
    assert incomplete.output[0].status == "incomplete" and events[-2]["item"]["status"] == "incomplete"
    renderer = _renderer()
    events = [*renderer.start(), *renderer.pieces([Content("a")]),
              *renderer.fail(ApiError(500, "the decoder died", "server_error", "actor_crashed"))]
    valid_events(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "the decoder died" and events[-2]["code"] == "actor_crashed"
    failed = valid_response(events[-1]["response"])
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"


def test_logprobs_ride_on_the_text_deltas_and_the_done_events() -> None:
    first = TokenLogprob("Hi", (72, 105), -0.5)
    second = TokenLogprob("!", (33,), -1.5)
    renderer = _renderer()
    events = [*renderer.start(), *renderer.pieces([], logprobs=[first]),  # text held back: logprobs wait for it
              *renderer.pieces([Content("Hi!")], logprobs=[second]), *renderer.finish(DONE)]
    valid_events(events)
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert [(p["token"], p["logprob"], p["bytes"]) for p in delta["logprobs"]] == [("Hi", -0.5, [72, 105]),
                                                                                   ("!", -1.5, [33])]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == delta["logprobs"]
    part = valid_response(events[-1]["response"]).output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and [p.token for p in part.logprobs] == ["Hi", "!"]


def test_whole_is_the_streamed_response() -> None:
    pieces = [Reasoning("r"), Content("text")]
    streamed = _renderer()
    events = [*streamed.start(), *streamed.pieces(pieces), *streamed.finish(DONE)]
    whole = _renderer().whole(pieces, DONE)
    strip = lambda r: [{k: v for k, v in item.items() if k != "id"} for item in r["output"]]  # noqa: E731
    assert strip(whole) == strip(events[-1]["response"]) and whole["status"] == "completed"
