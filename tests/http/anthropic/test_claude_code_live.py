"""Claude-Code-shaped requests through the real engine: the scripted tiny model behind the real HTTP stack.

The model (tests/clients/scripted_model.py) answers REPLY then EOS whatever
the prompt, with a tool-calling template and a 131072-token context, so a
Claude Code body (24 tools, adaptive thinking, a mid-conversation system
message, max_tokens 64000) renders, prefills and ends its turn like a real
one. Here: the whole and the streamed answer, `count_tokens` against the
request's usage, and prefix hygiene (two requests that differ only in the
billing-header block share their prompt from the cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from tests.clients.scripted_model import scripted_model
from tests.http.anthropic.claude_code_body import BETAS, claude_code_body, without
from tests.http.http_helpers import ServerThread

from mlx_trio.config import EngineConfig
from mlx_trio.http import ServerConfig

REPLY = "The tiny model says pong."


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scripted_model(REPLY, tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module", params=[False, True], ids=["default", "keep-billing-header"])
def claude(request: pytest.FixtureRequest, model: Path) -> Iterator[tuple[anthropic.Anthropic, bool]]:
    keep = request.param
    with ServerThread(EngineConfig(model=str(model)), ServerConfig(port=0, keep_billing_header=keep)) as server, \
            anthropic.Anthropic(base_url=server.url, api_key="sk-ant-dummy", max_retries=0, timeout=120) as sdk:
        yield sdk, keep


def test_a_claude_code_turn_whole_and_streamed_and_counted(claude: tuple[anthropic.Anthropic, bool]) -> None:
    """The reply as one text block, end_turn; the stream ends the same; count_tokens is the prompt's size."""
    client, _ = claude
    body = claude_code_body(with_history=True)
    counted = client.beta.messages.count_tokens(model="claude-opus-4-8", betas=BETAS,
                                                **without(body, "max_tokens", "metadata"))
    message = client.beta.messages.create(model="claude-opus-4-8", betas=BETAS, **body)
    assert [(b.type, b.text) for b in message.content] == [("text", REPLY)] and message.stop_reason == "end_turn"
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 1000
    with client.beta.messages.stream(model="claude-opus-4-8", betas=BETAS, **body) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.text) for b in streamed.content] == [("text", REPLY)] and streamed.stop_reason == "end_turn"
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == counted.input_tokens
    assert streamed.usage.output_tokens == usage.output_tokens


def test_requests_differing_only_in_the_billing_header_share_the_cache(claude: tuple[anthropic.Anthropic, bool]) -> None:
    """Dropped (the default), the billing block cannot split the prefix: the second request reads ≥ 95 % of
    its prompt from the cache. Kept (--keep-billing-header), it sits in front of everything: almost nothing."""
    client, keep = claude
    usages = []
    for session in ("4f1c2a", "9be07d"):
        body = claude_code_body("Say ping.", session=session)
        usages.append(client.beta.messages.create(model="claude-opus-4-8", betas=BETAS, **body).usage)
    second = usages[1]
    share = second.cache_read_input_tokens / (second.input_tokens + second.cache_read_input_tokens)
    if keep:
        assert share < 0.05
    else:
        assert share >= 0.95
