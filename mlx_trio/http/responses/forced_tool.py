"""The router of an answer that is wholly one custom tool's input (a forced custom tool with a grammar).

The grammar shapes the whole output, so there are no markers to split:
the text is the tool's input, given as one call when generation ends. It
has the `OutputRouter` surface the Responses stream uses (`feed`,
`finish`, `num_tool_calls`).
"""

from __future__ import annotations

import json
import uuid

from mlx_trio.http.completion.output_router import Piece, ToolCall, ToolCallMade


class ForcedToolRouter:
    def __init__(self, name: str) -> None:
        self._name = name
        self._texts: list[str] = []
        self.num_tool_calls = 0

    def feed(self, text: str) -> list[Piece]:
        self._texts.append(text)
        return []

    def finish(self) -> list[Piece]:
        self.num_tool_calls = 1
        # Arguments as a template-rendered custom call carries them, so both read back the same way.
        arguments = json.dumps({"input": "".join(self._texts)}, ensure_ascii=False)
        return [ToolCallMade(0, ToolCall(f"call_{uuid.uuid4().hex[:24]}", self._name, arguments))]
