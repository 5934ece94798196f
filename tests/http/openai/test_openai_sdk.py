"""The official `openai` SDK, unmodified, against a live server on a tiny real model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tests.http.http_helpers import ServerThread

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def client(live_server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


def _stream_text(chunks: Any, *, chat: bool) -> tuple[str, list[Any]]:
    chunks = list(chunks)
    if chat:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


def test_chat_completion_with_usage(client: openai.OpenAI) -> None:
    """A non-streamed chat completion has an assistant message, a finish reason and full usage."""
    done = client.chat.completions.create(model="any", messages=CHAT, max_tokens=6)
    assert done.id.startswith("chatcmpl-")
    assert done.object == "chat.completion"
    assert done.system_fingerprint
    choice = done.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert done.usage is not None
    assert done.usage.prompt_tokens > 0 and 1 <= done.usage.completion_tokens <= 6
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.usage.prompt_tokens_details is not None and done.usage.prompt_tokens_details.cached_tokens == 0


def test_text_completion_with_usage(client: openai.OpenAI) -> None:
    """A non-streamed text completion has text, finish_reason "length" at max_tokens, and usage."""
    done = client.completions.create(model="any", prompt=PROMPT, max_tokens=5, temperature=0)
    assert done.id.startswith("cmpl-") and done.object == "text_completion"
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 5


def test_streamed_chat_equals_non_streamed_for_greedy(client: openai.OpenAI) -> None:
    """Greedy streamed chat text equals the non-streamed text; the usage chunk matches its usage."""
    whole = client.chat.completions.create(model="any", messages=CHAT, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="any", messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, chunks = _stream_text(stream, chat=True)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_text_equals_non_streamed_for_greedy(client: openai.OpenAI) -> None:
    """Greedy streamed text completion equals the non-streamed one; without include_usage there is no usage."""
    whole = client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0)
    text, chunks = _stream_text(client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0,
                                                          stream=True), chat=False)
    assert text == whole.choices[0].text
    assert all(getattr(c, "usage", None) is None for c in chunks)


def test_stop_string_cuts_the_text_and_finishes_with_stop(client: openai.OpenAI) -> None:
    """A stop string taken from the greedy output ends the text right before it, finish_reason "stop"."""
    full = client.completions.create(model="any", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    # Two characters that first occur after the start, so the expected text is non-empty.
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2)
                if full[i:i + 2].strip() and full.index(full[i:i + 2]) >= 3)
    for stream in (False, True):
        if stream:
            text, chunks = _stream_text(client.completions.create(model="any", prompt=PROMPT, max_tokens=16,
                                                                  temperature=0, stop=[stop], stream=True), chat=False)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            done = client.completions.create(model="any", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop)
            text, finish = done.choices[0].text, done.choices[0].finish_reason
        assert text == full[: full.index(stop)]
        assert finish == "stop"


def test_logit_bias_on_eos_finishes_immediately(client: openai.OpenAI, live_server: ServerThread) -> None:
    """Biasing the EOS token by +100 makes the first token EOS: finish "stop", empty text, one token."""
    engine = live_server.server.state.engine  # type: ignore[union-attr]
    eos = min(live_server.call(lambda: engine.model.eos_token_ids))
    done = client.chat.completions.create(model="any", messages=CHAT, max_tokens=10, logit_bias={str(eos): 100})
    assert done.choices[0].finish_reason == "stop"
    assert not done.choices[0].message.content
    assert done.usage is not None and done.usage.completion_tokens == 1


def test_models_list(client: openai.OpenAI) -> None:
    """The SDK lists the one served model."""
    models = client.models.list().data
    assert len(models) == 1 and models[0].id


def test_sdk_sees_openai_errors(client: openai.OpenAI) -> None:
    """A bad field raises BadRequestError carrying the field as `param`; n > 1 is refused."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="any", messages=CHAT, temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="any", messages=CHAT, n=2)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="any", prompt="hi " * 5000, max_tokens=10)
    assert info.value.code == "context_length_exceeded"
