"""The OpenAI Agents SDK (PyPI `openai-agents`, the `clients` extra) with a function tool (issue #44).

Both of its OpenAI models: `OpenAIResponsesModel` (`/v1/responses`) and
`OpenAIChatCompletionsModel` (`/v1/chat/completions`). Tracing is off
(`set_tracing_disabled(True)`): it would export every run to OpenAI.
Skipped when the SDK is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from tests.clients.conftest import REPLY, Served
from tests.clients.turns import ConversationEngine, native_call
from tests.http.http_helpers import serve_fake

from mlx_trio.output_format import OutputFormat

pytestmark = pytest.mark.slow
agents = pytest.importorskip("agents")

FINAL = "It is sunny in Paris."
MODELS = ["responses", "chat_completions"]


def _run(base_url: str, wire: str) -> tuple[Any, list[str]]:
    """One `Runner.run_sync` of an agent with the `get_weather` tool; the result and the cities it was asked."""
    import openai  # noqa: PLC0415

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model_class = agents.OpenAIResponsesModel if wire == "responses" else agents.OpenAIChatCompletionsModel
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    agent = agents.Agent(name="Weather", instructions="Look the weather up.", tools=[get_weather],
                         model=model_class(model="tiny", openai_client=client))
    return agents.Runner.run_sync(agent, "Weather in Paris?"), seen


@pytest.mark.parametrize("wire", MODELS)
async def test_an_agent_runs_a_function_tool(tools_format: OutputFormat, wire: str) -> None:
    """The model calls the tool, the SDK runs it and sends its output back; the second answer is the result."""
    engine = ConversationEngine(tools_format, native_call("get_weather", {"city": "Paris"}), FINAL)
    async with serve_fake(engine) as (server, _):
        result, seen = await trio.to_thread.run_sync(_run, f"{server.url}/v1", wire)
    assert seen == ["Paris"]
    assert result.final_output == FINAL
    assert engine.answers == [engine.call, engine.final]
    assert [[t["function"]["name"] for t in kwargs["tools"]] for _, kwargs in engine.prepared] == [["get_weather"]] * 2
    second = engine.prepared[1][0]
    call_id = second[-2]["tool_calls"][0]["id"]
    assert second[-2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert second[-1] == {"role": "tool", "tool_call_id": call_id, "content": "sunny in Paris"}


@pytest.mark.parametrize("wire", MODELS)
def test_an_agent_with_a_tool_gets_the_served_models_reply(served: Served, wire: str) -> None:
    """`mlx-trio serve` on the scripted tiny model: offered the tool, it answers its text, which ends the run."""
    result, seen = _run(f"{served.url}/v1", wire)
    assert seen == [] and result.final_output == REPLY
