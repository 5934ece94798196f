"""`CompletionCall`: one parsed completion request, whatever wire API it came in by.

Each wire API's parser (`openai/requests.py`, `anthropic/requests.py`)
checks its JSON shapes and builds one; the shared path (`serve.py`) hands it
to `Engine.prepare` and maps the engine's errors back to the body's own keys
(`in_wire_terms`). Semantic checks (chat roles, message contents, template
arguments) are the engine's, run once in `Engine.prepare`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from mlx_trio.errors import ContextTooLong, InvalidParameter, RequestError
from mlx_trio.http.completion.tools import NO_TOOLS, ToolsRequest
from mlx_trio.http.server.body import optional_field


@attrs.frozen
class CompletionCall:
    """One parsed completion request: the prompt, how to sample, how to answer.

    `prompt` is what `Engine.prepare` takes: a string or token ids for text
    completions, a list of message objects for chat. `prompt_field` is the
    body key it came from, used to name it in errors raised later.
    """

    chat: bool
    prompt: Any
    sampling: Mapping[str, Any] = attrs.field(converter=lambda m: MappingProxyType(dict(m)), hash=False)
    chat_template_kwargs: Mapping[str, Any] | None
    stream: bool
    include_usage: bool
    tools: ToolsRequest = NO_TOOLS
    # The body's `model`: an adapter's name selects it; the base model's name, "default" or None is the base.
    model: str | None = None

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.sampling.get("logprobs"))

    def prepare_kwargs(self) -> dict[str, Any]:
        return {"chat_template_kwargs": self.chat_template_kwargs, **self.sampling}

    def in_wire_terms(self, exc: RequestError) -> RequestError:
        """Name the body key the client used in an error raised by `Engine.prepare`."""
        if isinstance(exc, InvalidParameter) and exc.field == "prompt" and self.chat:
            return InvalidParameter("messages", exc.message)
        if isinstance(exc, ContextTooLong) and exc.field != self.prompt_field:
            return ContextTooLong(exc.message, field=self.prompt_field)
        if isinstance(exc, InvalidParameter) and exc.field == "constraint":
            # The grammar came from response_format, or else from tool_choice (see serve.tool_kwargs).
            return InvalidParameter("response_format" if "constraint" in self.sampling else "tool_choice", exc.message)
        return exc


def template_kwargs(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any] | None:
    """The body's `chat_template_kwargs` over the server's defaults (`--chat-template-args`), None if both are empty.

    Which names a request may set is the engine's rule (`Engine.prepare`
    refuses the template's own arguments, naming `chat_template_kwargs.<name>`).
    """
    given = optional_field(body, "chat_template_kwargs", dict) or {}
    merged = {**defaults, **given}
    return merged or None
