"""engine/model/generic_tools.py: the chat a template without a tool format gets, tools and history included."""

from __future__ import annotations

from mlx_trio.engine.model.generic_tools import INSTRUCTION, generic_chat, tools_prompt

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = {"role": "user", "content": "Weather in Paris?"}
TOOLS_PROMPT = (
    "You can use these tools:\n"
    '{"name": "get_weather", "description": "Weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}\n'
    '{"name": "get_time", "parameters": {"type": "object"}}\n\n' + INSTRUCTION
)


def test_tools_prompt_lists_each_tool_then_the_instruction() -> None:
    assert tools_prompt([WEATHER, TIME]) == TOOLS_PROMPT


def test_tools_go_into_a_new_system_message_or_after_the_given_one() -> None:
    """No system message: one in front; a system message: the tools after its text."""
    assert generic_chat([ASK], [WEATHER, TIME]) == [{"role": "system", "content": TOOLS_PROMPT}, ASK]
    system = {"role": "system", "content": "Be brief."}
    assert generic_chat([system, ASK], [WEATHER, TIME]) == [
        {"role": "system", "content": "Be brief.\n\n" + TOOLS_PROMPT}, ASK]


def test_without_a_system_role_the_tools_top_the_first_user_message() -> None:
    assert generic_chat([ASK], [TIME], system_role=False) == [
        {"role": "user", "content": tools_prompt([TIME]) + "\n\nWeather in Paris?"}]


def test_history_calls_and_results_become_plain_turns() -> None:
    """A call is the assistant's call JSON (after its text); results, named from their call, join the next user turn."""
    history = [ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "user", "content": "Thanks"}]
    assert generic_chat(history, None) == [
        ASK,
        {"role": "assistant", "content": 'Checking.\n{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}},'
                                         '{"name":"get_time","arguments":{}}]}'},
        {"role": "user", "content": "Tool result from get_weather:\nsunny\n\nTool result from get_time:\nnoon\n\nThanks"},
    ]
