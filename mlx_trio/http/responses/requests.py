"""Responses bodies (`POST /v1/responses`) → the shared `CompletionCall`, plus what the response echoes.

Only wire shapes are checked here (items, flat tools, `text.format`,
`max_output_tokens`); sampling values and the chat itself are checked once,
by `Engine.prepare`, as for the other wire APIs, and its errors name the
Responses field (`ResponsesCompletionCall.in_wire_terms`). Fields that
change nothing here are accepted and echoed (`reasoning`, `include`,
`prompt_cache_key`, `metadata`, `truncation`, `user`, `service_tier`, …);
those whose effect this server cannot give are refused (`background`,
`conversation`, `prompt`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from mlx_trio.errors import ContextTooLong, InvalidParameter, RequestError
from mlx_trio.http.completion.call import CompletionCall, template_kwargs
from mlx_trio.http.completion.tools import template_messages
from mlx_trio.http.server.body import is_int, json_type, optional_field, type_field
from mlx_trio.params import MAX_TOP_LOGPROBS, Constraint
from mlx_trio.http.responses.items import chat_messages, normalized_input, with_id
from mlx_trio.http.responses.store import StoredResponse
from mlx_trio.http.responses.tools import ResponsesTools, parse_tools

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Passed to the engine under the same names (ours where OpenAI has none); the engine checks their values.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size",
                   "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size",
                   "logit_bias", "seed", "stop", "speculative")
# Accepted and echoed: they change nothing a local model does (see docs/api.md).
_STRING_FIELDS = ("user", "prompt_cache_key", "safety_identifier", "service_tier", "prompt_cache_retention")
_REFUSED = {"background": "background responses are not supported; send stream or wait for the answer",
            "conversation": "conversations are not supported; use previous_response_id or send the history",
            "prompt": "prompt templates are not supported; send input and instructions"}
# The engine's (and the shared call's) names → the Responses field an error about them names.
_FIELD_NAMES = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "logprobs": "include"}


@attrs.frozen
class ResponsesCompletionCall(CompletionCall):
    """The shared call of a Responses request: its errors name Responses fields.

    `forced_tool` names the custom tool whose grammar (in `sampling`'s
    constraint) shapes the whole answer, when one is forced.
    """

    forced_tool: str | None = None

    def in_wire_terms(self, exc: RequestError) -> RequestError:
        exc = super().in_wire_terms(exc)
        field = getattr(exc, "field", None)
        if self.forced_tool is not None and isinstance(exc, InvalidParameter) and field == "response_format":
            return InvalidParameter(f"tools ({self.forced_tool}).format", exc.message)
        return _renamed(exc)


def _renamed(exc: RequestError) -> RequestError:
    """`exc` naming the Responses field where it names the engine's (a message's fields: `input`)."""
    field = getattr(exc, "field", None)
    if isinstance(field, str) and field.startswith("messages["):
        field = "messages"
    if field not in _FIELD_NAMES:
        return exc
    if isinstance(exc, ContextTooLong):
        return ContextTooLong(exc.message, field=_FIELD_NAMES[field])
    if isinstance(exc, InvalidParameter):
        return InvalidParameter(_FIELD_NAMES[field], exc.message)
    return exc


@attrs.frozen
class ResponsesCall:
    """One parsed Responses request.

    `call` is what the shared completion path runs. `input_items` are this
    request's items, each with an id (what `input_items` lists);
    `context` is the whole conversation the prompt was built from (the
    previous response's context, then `input_items`). `echo` holds the
    request fields the response object repeats.
    """

    call: ResponsesCompletionCall
    tools: ResponsesTools
    input_items: tuple[Mapping[str, Any], ...]
    context: tuple[Mapping[str, Any], ...]
    echo: Mapping[str, Any] = attrs.field(converter=lambda m: MappingProxyType(dict(m)), hash=False)
    store: bool = True


def parse_responses(body: Mapping[str, Any], *, template_defaults: Mapping[str, Any],
                    previous: StoredResponse | None) -> ResponsesCall:
    """Validate a Responses body; `previous` is the stored response `previous_response_id` names."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise InvalidParameter(name, why)
    model = optional_field(body, "model", str)
    optional_field(body, "previous_response_id", str)
    for name in _STRING_FIELDS:
        optional_field(body, name, str)
    for name in ("metadata", "reasoning", "stream_options"):
        optional_field(body, name, dict)
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise InvalidParameter("truncation", f"must be 'auto' or 'disabled', got {body['truncation']!r:.40}")
    instructions = optional_field(body, "instructions", str)
    store = optional_field(body, "store", bool) is not False
    include = _include(body.get("include"))
    items = normalized_input(body.get("input"))
    if not items:
        raise InvalidParameter("input", "must not be empty")
    earlier = previous.context if previous is not None else ()
    input_items = tuple(with_id(item) for item in items)
    context = (*earlier, *input_items)
    messages = template_messages(chat_messages(context, instructions=instructions, first_input=len(earlier)))
    tools = parse_tools(body)
    sampling = _sampling(body, include)
    if tools.forced is not None:
        if "constraint" in sampling:
            raise InvalidParameter("text.format", f"cannot be combined with forcing the custom tool "
                                                  f"{tools.forced_name!r}, whose grammar shapes the whole answer")
        sampling["constraint"] = tools.forced
    call = ResponsesCompletionCall(chat=True, prompt=messages, sampling=sampling,
                                   chat_template_kwargs=template_kwargs(body, template_defaults),
                                   stream=bool(optional_field(body, "stream", bool)), include_usage=True,
                                   tools=tools.request, forced_tool=tools.forced_name, model=model)
    return ResponsesCall(call, tools, input_items, context, _echo(body, instructions), store)


def _include(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidParameter("include", f"must be a list of strings, got {json_type(value)}")
    return tuple(value)


def _sampling(body: Mapping[str, Any], include: tuple[str, ...]) -> dict[str, Any]:
    """The engine's sampling keywords for the body (values are checked by `Engine.prepare`)."""
    sampling = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    budget = body.get("max_output_tokens")
    if budget is not None:
        if not is_int(budget) or budget < 1:
            raise InvalidParameter("max_output_tokens", f"must be an integer >= 1, got {budget!r:.40}")
        sampling["max_tokens"] = budget
    top_logprobs = optional_field(body, "top_logprobs", int)
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidParameter("top_logprobs", f"must be an integer between 0 and {MAX_TOP_LOGPROBS}")
    if LOGPROBS_INCLUDE in include or top_logprobs is not None:
        sampling.update(logprobs=True, top_logprobs=top_logprobs or 0)
    text = optional_field(body, "text", dict) or {}
    constraint = _text_format(text.get("format"))
    if constraint is not None:
        sampling["constraint"] = constraint
    return sampling


def _text_format(value: Any) -> Constraint | None:
    """`text.format` → the grammar that enforces it (None for plain text)."""
    if value is None:
        return None
    kind = type_field(value, "text.format")
    if not isinstance(value, dict):
        raise InvalidParameter("text.format", f"must be an object, got {json_type(value)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        if not isinstance(value.get("schema"), dict):
            raise InvalidParameter("text.format.schema", f"must be a JSON schema object, got "
                                                         f"{json_type(value.get('schema'))}")
        return Constraint("json_schema", json.dumps(value["schema"]))
    raise InvalidParameter("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r:.40}")


def _echo(body: Mapping[str, Any], instructions: str | None) -> dict[str, Any]:
    """The request fields a response object repeats, with OpenAI's defaults."""
    text = dict(body.get("text") or {})
    text.setdefault("format", {"type": "text"})
    text.setdefault("verbosity", "medium")
    reasoning = body.get("reasoning") or {}
    return {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": body.get("service_tier") or "default",
        "store": body.get("store") is not False,
        "temperature": body.get("temperature"),
        "text": text,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": list(body.get("tools") or []),
        "top_logprobs": body.get("top_logprobs") or 0,
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
    }
