"""The OpenAI Agents SDK (`openai-agents`, its default Responses model) against the server: the slow tier.

An agent with one function tool and a handoff. A random-weight model does
not choose tools, so the scripted engine (QWEN3_TOOLS markers) plays the
model: it calls the tool, then the handoff (a tool call too), then the
second agent answers. Skipped when `openai-agents` is not installed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from tests.http.fakes import ScriptedEngine
from tests.http.http_helpers import serve_fake

from mlx_trio.output_format import OutputFormat

pytestmark = pytest.mark.slow
agents = pytest.importorskip("agents")


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _run_agents(base_url: str) -> Any:
    import openai  # noqa: PLC0415

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    expert = agents.Agent(name="Expert", instructions="Answer from the weather.", model=model)
    triage = agents.Agent(name="Triage", instructions="Look the weather up, then hand off.", model=model,
                          tools=[get_weather], handoffs=[expert])
    result = agents.Runner.run_sync(triage, "Weather in Paris?")
    return result, seen


async def test_an_agent_calls_a_tool_and_hands_off(tools_format: OutputFormat) -> None:
    engine = ScriptedEngine(tools_format, [_call("get_weather", {"city": "Paris"}),
                                           _call("transfer_to_expert", {}), "It is sunny in Paris."])
    async with serve_fake(engine) as (server, _):
        result, seen = await trio.to_thread.run_sync(_run_agents, f"{server.url}/v1")
    assert seen == ["Paris"]
    assert result.final_output == "It is sunny in Paris." and result.last_agent.name == "Expert"
    tool_names = [sorted(t["function"]["name"] for t in (kwargs["tools"] or [])) for _, kwargs in engine.prepared]
    assert tool_names[:2] == [["get_weather", "transfer_to_expert"]] * 2 and tool_names[2] == []
    second_prompt = engine.prepared[1][0]
    assert second_prompt[-1] == {"role": "tool", "tool_call_id": second_prompt[-2]["tool_calls"][0]["id"],
                                 "content": "sunny in Paris"}
