"""`ConversationEngine`: the scripted engine of tests/http, answering by the conversation's state.

A real agent turn with one tool call is: the model calls a tool, the client
runs it and sends the result back, the model answers. The scripted *model*
of `scripted_model.py` cannot write a call (its chain needs distinct tokens,
and a call's JSON repeats them), so these turns run on the scripted engine
behind the real HTTP stack. Clients also send side requests beside the main
one (OpenCode's session title, without tools), and in no fixed order, so the
answer is chosen from the request itself, not from the order of arrival.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import trio
from tests.http.fakes import FakeRequest, ScriptedEngine

from mlx_trio.events import Finished, GenerationEvent, PromptProgress, TextDelta, Usage
from mlx_trio.output_format import OutputFormat


def native_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call in the QWEN3_TOOLS model's own format (Hermes `<tool_call>` JSON)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n</tool_call>"


class ConversationEngine(ScriptedEngine):
    """`call` while no tool result is in the prompt and tools are offered; `final` once a tool result is;
    `side` for a request without tools. `answers` records each request's choice, in order of arrival."""

    def __init__(self, output_format: OutputFormat, call: str, final: str, side: str = "A title") -> None:
        super().__init__(output_format, [])
        self.call, self.final, self.side = call, final, side
        self.answers: list[str] = []
        self._chosen: dict[int, str] = {}

    def prepare(self, prompt: Any, **kwargs: Any) -> FakeRequest:
        request = super().prepare(prompt, **kwargs)
        roles = [m.get("role") for m in prompt] if isinstance(prompt, list) else []
        answer = self.final if "tool" in roles else self.call if kwargs.get("tools") else self.side
        self.answers.append(answer)
        self._chosen[id(request)] = answer
        return request

    async def stream(self, request: FakeRequest) -> AsyncGenerator[GenerationEvent, None]:
        text = self._chosen.pop(id(request))
        yield PromptProgress(request.prompt_tokens, request.prompt_tokens)
        for i in range(0, len(text), self.chars_per_delta):
            await trio.lowlevel.checkpoint()
            yield TextDelta(text[i:i + self.chars_per_delta], (i,))
        yield Finished("stop", Usage(request.prompt_tokens, len(text)))

    def tool_results(self) -> list[Mapping[str, Any]]:
        """The tool messages of the request that carried them (the first prompt with one)."""
        for prompt, _ in self.prepared:
            tools = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "tool"]
            if tools:
                return tools
        return []
