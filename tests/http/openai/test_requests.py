"""Body parsing (`http/openai/requests.py`) on its own: aliases, shapes, defaults, wire-level ranges."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_trio.errors import ContextTooLong, InvalidParameter
from mlx_trio.http.openai.requests import parse_chat, parse_text
from mlx_trio.params import Constraint

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**body: Any):  # type: ignore[no-untyped-def]
    return parse_chat({"messages": MESSAGES, **body}, template_defaults={})


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    """OpenAI's newer name takes precedence, as in mlx_lm.server; either alone works."""
    assert chat(max_tokens=5, max_completion_tokens=2).sampling["max_tokens"] == 2
    assert chat(max_tokens=5).sampling["max_tokens"] == 5
    assert "max_tokens" not in chat().sampling


def test_null_fields_mean_the_server_default() -> None:
    """null sampling fields are dropped, so the engine's defaults (--temp, ...) apply."""
    call = chat(temperature=None, top_p=None, stop=None, seed=None, max_tokens=None, n=None, stream=None)
    assert dict(call.sampling) == {} and call.stream is False


def test_sampling_fields_pass_through_under_their_names() -> None:
    """Every SamplingParams field the API knows is forwarded to Engine.prepare unchanged."""
    fields = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
              "repetition_context_size": 10, "presence_penalty": 0.2, "presence_context_size": 8,
              "frequency_penalty": 0.3, "frequency_context_size": 9, "logit_bias": {"3": -5}, "seed": 7,
              "stop": ["x"]}
    assert dict(chat(**fields).sampling) == fields


def test_chat_template_kwargs_merge_over_the_server_defaults() -> None:
    """--chat-template-args are defaults; a request's chat_template_kwargs override them key by key."""
    call = parse_chat({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True, "x": 1}},
                      template_defaults={"enable_thinking": False, "y": 2})
    assert call.chat_template_kwargs == {"enable_thinking": True, "x": 1, "y": 2}
    assert parse_chat({"messages": MESSAGES}, template_defaults={}).chat_template_kwargs is None


def test_stream_options() -> None:
    """include_usage is optional inside stream_options and defaults to false."""
    assert chat(stream=True, stream_options={}).include_usage is False
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True


@pytest.mark.parametrize(("prompt", "expected"), [("hi", "hi"), (["hi"], "hi"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])])
def test_text_prompt_shapes(prompt: Any, expected: Any) -> None:
    """A string, token ids, or a batch of exactly one of those."""
    assert parse_text({"prompt": prompt}, template_defaults={}).prompt == expected


@pytest.mark.parametrize(("body", "field"), [
    ({"top_k": 2**31}, "top_k"),
    ({"repetition_context_size": 2**40}, "repetition_context_size"),
    ({"seed": 2**64}, "seed"),
    ({"logit_bias": {"1": -101}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_wire_level_ranges(body: dict[str, Any], field: str) -> None:
    """Integers beyond what MLX takes, and biases beyond OpenAI's ±100, are refused naming the field."""
    with pytest.raises(InvalidParameter) as info:
        chat(**body)
    assert info.value.field == field


def test_errors_from_prepare_are_renamed_to_the_body_key() -> None:
    """Engine.prepare says "prompt"; for chat the body key is "messages"."""
    call = chat()
    assert call.in_wire_terms(InvalidParameter("prompt", "x")).field == "messages"  # type: ignore[attr-defined]
    assert call.in_wire_terms(ContextTooLong("too long", field="prompt")).field == "messages"  # type: ignore[attr-defined]
    text = parse_text({"prompt": "hi"}, template_defaults={})
    assert text.in_wire_terms(ContextTooLong("too long")).field == "prompt"  # type: ignore[attr-defined]


def test_logprobs_in_both_spellings() -> None:
    """Chat: a bool plus top_logprobs; text: an int, the number of top logprobs (0 = the sampled token's only)."""
    assert chat(logprobs=True, top_logprobs=4).sampling["top_logprobs"] == 4
    assert chat(logprobs=True).sampling["logprobs"] is True and chat(logprobs=True).wants_logprobs
    assert "logprobs" not in chat(logprobs=False).sampling and not chat().wants_logprobs
    text = parse_text({"prompt": "hi", "logprobs": 0}, template_defaults={})
    assert text.wants_logprobs and text.sampling["top_logprobs"] == 0
    assert not parse_text({"prompt": "hi", "logprobs": False}, template_defaults={}).wants_logprobs


def test_response_format_becomes_a_constraint() -> None:
    """json_object is any object; json_schema carries the schema's JSON text; text is no constraint."""
    assert chat(response_format={"type": "json_object"}).sampling["constraint"] == Constraint(
        "json_schema", '{"type": "object"}')
    call = chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})
    assert call.sampling["constraint"] == Constraint("json_schema", '{"type": "integer"}')
    assert "constraint" not in chat(response_format={"type": "text"}).sampling


def test_constraint_errors_name_the_body_key_the_grammar_came_from() -> None:
    """Engine.prepare says "constraint"; the body key is response_format, or else tool_choice."""
    with_format = chat(response_format={"type": "json_object"})
    error = with_format.in_wire_terms(InvalidParameter("constraint", "unsupported"))
    assert isinstance(error, InvalidParameter) and error.field == "response_format"
    error = chat().in_wire_terms(InvalidParameter("constraint", "unsupported"))
    assert isinstance(error, InvalidParameter) and error.field == "tool_choice"
