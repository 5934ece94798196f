"""Responses bodies (`POST /v1/responses`) → the shared `CompletionCall`, plus what the response echoes.

The body is checked in Responses terms (items, flat tools, `text.format`,
`max_output_tokens`), then handed to the chat completions parser as the
chat body it amounts to, so every sampling field is validated exactly as
for chat; errors name the Responses field (`in_wire_terms`). Fields that
change nothing here are accepted and echoed (`reasoning`, `include`,
`prompt_cache_key`, `metadata`, `truncation`, `user`, `service_tier`, …);
those whose effect this server cannot give are refused (`background`,
`conversation`, `prompt`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from mlx_trio.errors import ContextTooLong, InvalidParameter, RequestError
from mlx_trio.http.openai.requests import CompletionCall, SAMPLING_FIELDS, json_type, optional_field, parse_chat
from mlx_trio.http.responses.items import chat_messages, normalized_input, with_id
from mlx_trio.http.responses.store import StoredResponse
from mlx_trio.http.responses.tools import ResponsesTools, parse_tools

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Accepted and echoed: they change nothing a local model does (see docs/api.md).
_STRING_FIELDS = ("user", "prompt_cache_key", "safety_identifier", "service_tier", "prompt_cache_retention")
_REFUSED = {"background": "background responses are not supported; send stream or wait for the answer",
            "conversation": "conversations are not supported; use previous_response_id or send the history",
            "prompt": "prompt templates are not supported; send input and instructions"}
# Chat body keys → the Responses field an error about them names.
_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                "response_format.type": "text.format.type", "response_format.json_schema": "text.format",
                "response_format.json_schema.schema": "text.format.schema", "logprobs": "include"}


@attrs.frozen
class ResponsesCall:
    """One parsed Responses request.

    `call` is what the shared completion path runs. `input_items` are this
    request's items, each with an id (what `input_items` lists);
    `context` is the whole conversation the prompt was built from (the
    previous response's context, then `input_items`). `echo` holds the
    request fields the response object repeats.
    """

    call: CompletionCall
    tools: ResponsesTools
    input_items: tuple[Mapping[str, Any], ...]
    context: tuple[Mapping[str, Any], ...]
    echo: Mapping[str, Any] = attrs.field(converter=lambda m: MappingProxyType(dict(m)), hash=False)
    store: bool = True

    def in_wire_terms(self, exc: RequestError) -> RequestError:
        """An error of `Engine.prepare` (or of the chat parser) naming the Responses field."""
        exc = self.call.in_wire_terms(exc)
        if self.tools.forced is not None and isinstance(exc, InvalidParameter) and exc.field == "response_format":
            return InvalidParameter(f"tools ({self.tools.forced_name}).format", exc.message)
        return renamed(exc)


def renamed(exc: RequestError) -> RequestError:
    field = getattr(exc, "field", None)
    if field not in _FIELD_NAMES:
        return exc
    if isinstance(exc, ContextTooLong):
        return ContextTooLong(exc.message, field=_FIELD_NAMES[field])
    if isinstance(exc, InvalidParameter):
        return InvalidParameter(_FIELD_NAMES[field], exc.message)
    return exc


def parse_responses(body: Mapping[str, Any], *, template_defaults: Mapping[str, Any],
                    previous: StoredResponse | None) -> ResponsesCall:
    """Validate a Responses body; `previous` is the stored response `previous_response_id` names."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise InvalidParameter(name, why)
    optional_field(body, "model", str)
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
    messages = chat_messages(context, instructions=instructions, first_input=len(earlier))
    tools = parse_tools(body)
    chat_body = _chat_body(body, messages, include)
    if tools.forced is not None:
        if "response_format" in chat_body:
            raise InvalidParameter("text.format", f"cannot be combined with forcing the custom tool "
                                                  f"{tools.forced_name!r}, whose grammar shapes the whole answer")
    try:
        call = parse_chat(chat_body, template_defaults=template_defaults)
    except RequestError as exc:
        raise renamed(exc) from None
    sampling = dict(call.sampling)
    if tools.forced is not None:
        sampling["constraint"] = tools.forced
    call = attrs.evolve(call, sampling=sampling, tools=tools.request, include_usage=True)
    return ResponsesCall(call, tools, input_items, context, _echo(body, instructions), store)


def _include(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidParameter("include", f"must be a list of strings, got {json_type(value)}")
    return tuple(value)


def _chat_body(body: Mapping[str, Any], messages: list[dict[str, Any]], include: tuple[str, ...]) -> dict[str, Any]:
    """The chat completions body this request amounts to (tools apart: `parse_tools` reads them)."""
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream")}
    for name in (*SAMPLING_FIELDS, "chat_template_kwargs"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    top_logprobs = body.get("top_logprobs")
    if LOGPROBS_INCLUDE in include or top_logprobs is not None:
        chat["logprobs"] = True
        chat["top_logprobs"] = top_logprobs
    text = optional_field(body, "text", dict) or {}
    response_format = _text_format(text.get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _text_format(value: Any) -> dict[str, Any] | None:
    """`text.format` → chat's `response_format` (json_schema's schema sits one level up in Responses)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParameter("text.format", f"must be an object, got {json_type(value)}")
    if value.get("type") == "json_schema":
        if not isinstance(value.get("schema"), dict):
            raise InvalidParameter("text.format.schema", f"must be a JSON schema object, got "
                                                         f"{json_type(value.get('schema'))}")
        return {"type": "json_schema", "json_schema": {"name": value.get("name"), "schema": value["schema"]}}
    return dict(value)


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
