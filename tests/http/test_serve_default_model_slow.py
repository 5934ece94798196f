"""`make serve`'s configuration (the default model, CLI defaults) driven by the unmodified `openai` SDK."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from tests.http.http_helpers import ServerThread

from mlx_trio.cli import build_parser, configs_from_args

pytestmark = pytest.mark.slow


def test_openai_sdk_against_the_default_model(tmp_path: Path) -> None:
    """With no --model, the SDK's chat call (streamed and not) answers "Paris" greedily, with usage."""
    engine_config, server_config = configs_from_args(
        build_parser().parse_args(["serve", "--port", "0", "--cache-dir", str(tmp_path)]))
    with ServerThread(engine_config, server_config).start(timeout_s=600) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        done = client.chat.completions.create(model="default", messages=messages, max_tokens=20)
        assert "Paris" in (done.choices[0].message.content or "")
        assert done.usage is not None and done.usage.completion_tokens >= 1
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="default", messages=messages, max_tokens=20, stream=True) if c.choices)
        assert streamed == done.choices[0].message.content
