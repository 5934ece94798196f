"""The engine's chat checks (`engine/model/chat.py`) on their own: what every caller's chat must be."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_trio.engine.model.chat import RESERVED_TEMPLATE_ARGS, check_chat, template_messages
from mlx_trio.errors import InvalidParameter
from mlx_trio.output_format import GENERIC, PLAIN

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_contents_become_one_string_each() -> None:
    """Text parts are joined and None is empty, as mlx_lm.server does; other keys pass through; the input is kept."""
    messages = [{"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "n"}]
    assert template_messages(messages) == [{"role": "system", "content": ""},
                                           {"role": "user", "content": "ab", "name": "n"}]
    assert messages[0]["content"] is None


@pytest.mark.parametrize(("message", "field"), [
    ({"content": "x"}, "messages[1].role"),
    ({"role": None, "content": "x"}, "messages[1].role"),
    ({"role": "user", "content": 5}, "messages[1].content"),
    ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}, "messages[1].content[1]"),
    ({"role": "user", "content": [{"type": "text", "text": 3}]}, "messages[1].content[0]"),
])
def test_bad_messages_name_the_field(message: dict[str, Any], field: str) -> None:
    """Roles must be strings and contents text; the error names the message (and part) by index."""
    with pytest.raises(InvalidParameter) as info:
        template_messages([{"role": "user", "content": "ok"}, message])
    assert info.value.field == field


@pytest.mark.parametrize("name", sorted(RESERVED_TEMPLATE_ARGS))
def test_every_reserved_template_argument_is_refused(name: str) -> None:
    """The template's own parameters and the template itself cannot come from a request."""
    with pytest.raises(InvalidParameter) as info:
        check_chat([{"role": "user", "content": "x"}], template_args={"enable_thinking": True, name: 1}, tools=None,
                   output_format=PLAIN, model_id="m")
    assert info.value.field == f"chat_template_kwargs.{name}"


def test_template_variables_of_the_models_own_are_accepted() -> None:
    """Anything else (enable_thinking, custom variables) is the template's business."""
    assert check_chat([{"role": "user", "content": "x"}], template_args={"enable_thinking": False, "x": 1},
                      tools=None, output_format=PLAIN, model_id="m") == [{"role": "user", "content": "x"}]


def test_tools_need_a_tool_calling_format() -> None:
    """A format with no tool syntax at all (neither native nor generic) refuses tools, naming `tools` and the model."""
    with pytest.raises(InvalidParameter) as info:
        check_chat([{"role": "user", "content": "x"}], template_args={}, tools=[TOOL], output_format=PLAIN,
                   model_id="tiny")
    assert info.value.field == "tools" and "tiny" in str(info.value)


def _m(role: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


NOTE = "<system>\nn\n</system>"


@pytest.mark.parametrize(("chat", "placed"), [
    ([_m("system", "a"), _m("system", "b"), _m("user", "u")], [_m("system", "a\n\nb"), _m("user", "u")]),
    # Claude Code's shape: a system message after the first user turn, last.
    ([_m("user", "u"), _m("system", "n")], [_m("user", f"u\n\n{NOTE}")]),
    ([_m("user", "u"), _m("assistant", "x"), _m("system", "n"), _m("user", "v")],
     [_m("user", "u"), _m("assistant", "x"), _m("user", f"{NOTE}\n\nv")]),
    # Tool results stay next to the call they answer; the note waits for the next user turn.
    ([_m("user", "u"), _m("assistant", "", tool_calls=[]), _m("system", "n"), _m("tool", "r")],
     [_m("user", "u"), _m("assistant", "", tool_calls=[]), _m("tool", "r"), _m("user", NOTE)]),
    ([_m("user", "u"), _m("assistant", "x"), _m("system", "n"), _m("assistant", "y")],
     [_m("user", "u"), _m("assistant", "x"), _m("user", NOTE), _m("assistant", "y")]),
])
def test_system_messages_are_placed_where_every_template_takes_them(chat: list[dict[str, Any]],
                                                                    placed: list[dict[str, Any]]) -> None:
    """One leading system message; later ones become user-side notes, roles still alternating."""
    assert template_messages(chat) == placed


def test_a_template_that_takes_system_only_first_renders_a_mid_conversation_one() -> None:
    """The Qwen2.5 / Gemma rule (a system message anywhere but first raises: calling the undefined `raise`) no longer fires."""
    from jinja2 import Environment  # noqa: PLC0415

    strict = Environment().from_string(
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise('system must be first') }}"
        "{% endif %}{{ m.role }}:{{ m.content }}|{% endfor %}")
    chat = [_m("system", "s"), _m("user", "u"), _m("system", "n"), _m("assistant", "x"), _m("system", "m")]
    assert strict.render(messages=template_messages(chat)) == (
        f"system:s|user:u\n\n{NOTE}|assistant:x|user:<system>\nm\n</system>|")


def test_the_generic_format_takes_tools_and_history_calls_must_name_one() -> None:
    """A model with the generic format accepts tools; a history call to a tool not in them names its field."""
    ask = {"role": "user", "content": "x"}
    assert check_chat([ask], template_args={}, tools=[TOOL], output_format=GENERIC, model_id="m") == [ask]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "nope", "arguments": {}}}]}
    with pytest.raises(InvalidParameter) as info:
        check_chat([ask, call], template_args={}, tools=[TOOL], output_format=GENERIC, model_id="m")
    assert info.value.field == "messages[1].tool_calls[0].function.name" and "'nope'" in info.value.message
    # Without tools (tool_choice none) the history is not checked against them.
    assert len(check_chat([ask, call], template_args={}, tools=None, output_format=GENERIC, model_id="m")) == 2
