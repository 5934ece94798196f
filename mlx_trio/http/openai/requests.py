"""Chat and text completion bodies → `Engine.prepare` arguments, naming the field on error.

Only wire concerns live here: OpenAI field names and aliases
(`max_completion_tokens`), shapes (`messages` vs `prompt`), the two spellings
of logprobs (chat's bool + `top_logprobs`, text's int), `response_format` into
a `Constraint`, fields we refuse rather than silently ignore (`n` > 1,
`echo`). Value ranges that depend on the model (top_k vs vocabulary, context
length), chat roles, message contents and template arguments are checked by
`Engine.prepare`, which raises the same `InvalidParameter`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.completion.call import CompletionCall, template_kwargs
from mlx_trio.http.completion.tools import template_messages
from mlx_trio.http.openai.tools import parse_openai_tools
from mlx_trio.http.server.body import is_int, json_type, optional_field
from mlx_trio.params import MAX_TOP_LOGPROBS, Constraint

# Passed through to SamplingParams under the same names (mlx_lm.server's names).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size",
    "frequency_penalty", "frequency_context_size",
    "logit_bias", "seed", "stop", "speculative",
)
# OpenAI's range for a logit bias; mlx-lm adds it to logits, so larger values only risk overflow.
MAX_ABS_LOGIT_BIAS = 100.0
# mx.random.seed takes an unsigned 64-bit integer.
MAX_SEED = 2**64 - 1
# Other integer fields are 32-bit on the wire: MLX slices with 32-bit indices, so a larger
# *_context_size would fail inside the decoder instead of here.
INT32_FIELDS = ("top_k", "repetition_context_size", "presence_context_size", "frequency_context_size")
MAX_INT32 = 2**31 - 1


def parse_chat(body: Mapping[str, Any], *, template_defaults: Mapping[str, Any]) -> CompletionCall:
    """`POST /v1/chat/completions`: `messages` plus the common fields."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidParameter("messages", f"must be a list of message objects, got {json_type(messages)}")
    if not messages:
        raise InvalidParameter("messages", "must not be empty")
    # Shapes only: roles and contents are the engine's to check (`Engine.prepare`, naming `messages[i]...`).
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidParameter(f"messages[{i}]", f"must be an object, got {json_type(message)}")
    tools = parse_openai_tools(body)
    call = _common(body, chat=True, prompt=template_messages(messages), template_defaults=template_defaults)
    logprobs = bool(optional_field(body, "logprobs", bool))
    top_logprobs = _top_logprobs(body, "top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise InvalidParameter("top_logprobs", "requires logprobs: true")
    return attrs.evolve(_with_logprobs(call, logprobs, top_logprobs or 0), tools=tools)


def parse_text(body: Mapping[str, Any], *, template_defaults: Mapping[str, Any]) -> CompletionCall:
    """`POST /v1/completions`: `prompt` (a string or token ids, one prompt) plus the common fields."""
    prompt = _text_prompt(body.get("prompt"))
    if body.get("echo") not in (None, False):
        raise InvalidParameter("echo", "is not supported")
    if body.get("suffix") not in (None, ""):
        raise InvalidParameter("suffix", "is not supported")
    if body.get("best_of") not in (None, 1):
        raise InvalidParameter("best_of", "only best_of=1 is supported")
    call = _common(body, chat=False, prompt=prompt, template_defaults=template_defaults)
    # The legacy endpoint's `logprobs` is the number of top logprobs (0: the sampled token's only).
    top_logprobs = None if body.get("logprobs") is False else _top_logprobs(body, "logprobs")
    return _with_logprobs(call, top_logprobs is not None, top_logprobs or 0)


def _top_logprobs(body: Mapping[str, Any], name: str) -> int | None:
    value = optional_field(body, name, int)
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidParameter(name, f"must be an integer between 0 and {MAX_TOP_LOGPROBS}, got {value}")
    return value


def _with_logprobs(call: CompletionCall, logprobs: bool, top_logprobs: int) -> CompletionCall:
    if not logprobs:
        return call
    return attrs.evolve(call, sampling={**call.sampling, "logprobs": True, "top_logprobs": top_logprobs})


def parse_response_format(value: Any) -> Constraint | None:
    """`response_format` → the `Constraint` that enforces it (None for plain text).

    `json_object` is any JSON object; `json_schema` takes `json_schema.schema`
    (OpenAI's nesting). Whether the schema can be enforced is checked by
    `Engine.prepare`, which names the field "constraint" (see `in_wire_terms`).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParameter("response_format", f"must be an object, got {json_type(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidParameter("response_format.json_schema", f"must be an object, got {json_type(spec)}")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidParameter("response_format.json_schema.schema",
                                   f"must be a JSON schema object, got {json_type(schema)}")
        return Constraint("json_schema", json.dumps(schema))
    raise InvalidParameter("response_format.type",
                           f"must be 'text', 'json_object' or 'json_schema', got {kind!r:.40}")


def _text_prompt(prompt: Any) -> str | list[int]:
    # OpenAI also takes a batch (a list of prompts); with n=1 only a batch of one makes sense.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParameter("prompt", "must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidParameter("prompt", "only one prompt per request is supported")
    raise InvalidParameter("prompt", f"must be a non-empty string or a list of token ids, got {json_type(prompt)}")


def _common(body: Mapping[str, Any], *, chat: bool, prompt: Any,
            template_defaults: Mapping[str, Any]) -> CompletionCall:
    model = optional_field(body, "model", str)
    optional_field(body, "user", str)
    stream = bool(optional_field(body, "stream", bool))
    include_usage = False
    options = optional_field(body, "stream_options", dict)
    if options is not None:
        include_usage = bool(optional_field(options, "include_usage", bool, field="stream_options.include_usage"))
    n = optional_field(body, "n", int)
    if n is not None and n != 1:
        raise InvalidParameter("n", f"only n=1 is supported, got {n}")
    sampling: dict[str, Any] = {}
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise InvalidParameter(name, f"must be an integer >= 1, got {value!r:.80}")
        sampling["max_tokens"] = value
        break  # max_completion_tokens (OpenAI's newer name) wins, as in mlx_lm.server
    for name in SAMPLING_FIELDS:
        if name in body and body[name] is not None:
            sampling[name] = body[name]
    _check_seed(sampling.get("seed"))
    for name in INT32_FIELDS:
        value = sampling.get(name)
        if isinstance(value, int) and not -MAX_INT32 - 1 <= value <= MAX_INT32:
            raise InvalidParameter(name, f"must fit in 32 bits (at most {MAX_INT32}), got {value}")
    _check_logit_bias(sampling.get("logit_bias"))
    constraint = parse_response_format(body.get("response_format"))
    if constraint is not None:
        sampling["constraint"] = constraint
    return CompletionCall(chat=chat, prompt=prompt, sampling=sampling,
                          chat_template_kwargs=template_kwargs(body, template_defaults) if chat else None,
                          stream=stream, include_usage=include_usage, model=model)


def _check_seed(seed: Any) -> None:
    if is_int(seed) and not 0 <= seed <= MAX_SEED:
        raise InvalidParameter("seed", f"must be between 0 and {MAX_SEED}, got {seed}")


def _check_logit_bias(bias: Any) -> None:
    if not isinstance(bias, dict):
        return  # SamplingParams rejects other types, naming the field
    for key, value in bias.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_ABS_LOGIT_BIAS:
            raise InvalidParameter("logit_bias",
                                   f"bias for token {key!r:.40} must be between -100 and 100, got {value}")
