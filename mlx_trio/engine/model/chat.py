"""What a chat must be before the model's template sees it: the semantic checks, once for every caller.

`Engine.prepare` (through `LoadedModel.encode`) is the one place these run,
for the embeddable API and for every HTTP wire API alike. HTTP checks only
its JSON shapes (a list of message objects, field types of its own wire
format) and renames the fields of the `InvalidParameter` raised here to the
body's own keys; the field names used here (`messages[i].role`,
`chat_template_kwargs.<name>`, `tools`) are already the OpenAI ones.
Pure Python: no MLX, so tests' fake engines run the same checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_trio.errors import InvalidParameter
from mlx_trio.output_format import OutputFormat

# `apply_chat_template`'s own parameters, and the template itself: as template variables they
# would change how the engine calls the template, or swap the model's template for the request's.
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_chat(messages: Sequence[Mapping[str, Any]], *, template_args: Mapping[str, Any],
               tools: Sequence[Mapping[str, Any]] | None, output_format: OutputFormat,
               model_id: str) -> list[dict[str, Any]]:
    """Raise `InvalidParameter` naming the field unless the chat can go to the template; return its messages.

    The messages come back as the template takes them (`template_messages`).
    `tools` need a model with a tool format: its template's, or the generic
    one (every model mlx-lm loads has one of the two). With `tools`, every
    call in the history must name one of them.
    """
    if tools and not output_format.accepts_tools:
        raise InvalidParameter("tools", f"model {model_id} has no tool-calling format; "
                                        "remove tools (or send tool_choice 'none')")
    check_template_args(template_args)
    if tools:
        check_history_calls(messages, tools)
    return template_messages(messages)


def check_history_calls(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> None:
    """Refuse an assistant call to a tool that is not in `tools`: the model would learn to call what it cannot."""
    names = {tool["function"]["name"] for tool in tools}
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, Mapping) else None
            name = function.get("name") if isinstance(function, Mapping) else None
            if name not in names:
                raise InvalidParameter(f"messages[{i}].tool_calls[{j}].function.name",
                                       f"calls {name!r:.60}, which is not in tools ({', '.join(sorted(names))}); "
                                       "add that tool to tools or drop the call from the history")


def check_template_args(template_args: Mapping[str, Any]) -> None:
    """Refuse template variables the engine sets itself, or that would replace the model's template."""
    reserved = sorted(RESERVED_TEMPLATE_ARGS & set(template_args))
    if not reserved:
        return
    name = reserved[0]
    if name == "chat_template":
        raise InvalidParameter("chat_template_kwargs.chat_template",
                               "cannot replace the model's chat template; a request renders with the one "
                               "the model was loaded with")
    raise InvalidParameter(f"chat_template_kwargs.{name}", "is set by the engine and cannot be overridden")


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each message with a string role and its content as one string (text parts joined, None → ""),
    system messages placed where every template takes them (`place_system_messages`).

    Text-part lists become one string, as mlx_lm.server does; other part types are refused.
    """
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidParameter(f"messages[{i}].role", "must be a string")
        out.append({**message, "content": content_text(message.get("content"), i)})
    return place_system_messages(out)


def place_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One leading system message at most; a later system message becomes a note in a user turn.

    Chat templates disagree on system messages: many take one, first, and
    raise on any other (Qwen2.5, Gemma, Mistral), others render them
    anywhere. Harnesses send them mid-conversation (Claude Code's agent and
    skill lists). So, for every template alike:

    - the leading run of system messages is joined (blank line between) into one;
    - a system message after the first non-system message becomes the text
      `<system>…</system>` merged into the user turn before it (appended) or,
      if the message before is not a user's, the user turn after it
      (prepended; tool results in between stay next to their call), else a
      user message of its own, so user and assistant turns still alternate
      for templates that insist on it.

    A note is not hoisted into the leading system message: the note stays
    where it was sent in the conversation, so the prompt before it, and the
    prompt cache's prefix, do not change when a note is added later.
    """
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out = messages[:lead]
    if lead > 1:
        out = [{**messages[0], "content": "\n\n".join(m["content"] for m in messages[:lead])}]
    pending: list[str] = []  # notes waiting for the next user turn
    for message in messages[lead:]:
        if message["role"] == "system":
            note = f"<system>\n{message['content']}\n</system>"
            if out and out[-1]["role"] == "user" and not pending:
                out[-1] = {**out[-1], "content": _joined(out[-1]["content"], note)}
            else:
                pending.append(note)
            continue
        if pending and message["role"] == "user":
            message = {**message, "content": _joined(*pending, message["content"])}
            pending = []
        elif pending and message["role"] != "tool":  # tool results stay next to the call they answer
            out.append({"role": "user", "content": _joined(*pending)})
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": _joined(*pending)})
    return out


def _joined(*texts: str) -> str:
    return "\n\n".join(t for t in texts if t)


def content_text(content: Any, index: int) -> str:
    """Message `index`'s content as the template gets it: a string, null (empty) or text parts joined; raises
    `InvalidParameter` naming the field for anything else."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter(f"messages[{index}].content", "must be a string, null or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidParameter(f"messages[{index}].content[{j}]",
                                   "only parts of type 'text' with a string 'text' are supported")
        texts.append(part["text"])
    return "".join(texts)
