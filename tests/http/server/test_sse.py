"""SSE framing (`http/server/sse.py`): every `data:` line survives a client that splits with `str.splitlines`."""

from __future__ import annotations

import json

import pytest
from tests.http.fakes import ScriptedEngine
from tests.http.http_helpers import serve_fake

from mlx_trio.http.server.sse import comment, event
from mlx_trio.output_format import PLAIN

# Line breaks to `str.splitlines` (httpx `iter_lines`, several SDK wrappers) but not to SSE or JSON.
UNICODE_BREAKS = "a\u0085b\u2028c\u2029d\x1ce\x1df\x1eg\x0bh\x0ci"


def test_event_data_has_no_character_splitlines_breaks_on() -> None:
    """The JSON escapes them, so the frame is one line and decodes back to the same text."""
    frame = event({"text": UNICODE_BREAKS}, name="delta").decode()
    lines = frame.splitlines()
    assert lines == ["event: delta", lines[1], ""] and lines[1].startswith("data: ")
    assert json.loads(lines[1].removeprefix("data: ")) == {"text": UNICODE_BREAKS}


def test_a_comment_is_one_line_to_splitlines() -> None:
    frame = comment(f"x{UNICODE_BREAKS}\ny").decode()
    assert frame.endswith("\n\n") and frame.splitlines() == [frame[:-2], ""]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}),
    ("/v1/responses", {"input": "hi"}),
])
async def test_every_wire_api_streams_unicode_line_breaks_escaped(path: str, body: dict) -> None:
    """Generated text holding U+0085, U+2028 and U+2029: each data line parses alone after splitlines."""
    async with serve_fake(ScriptedEngine(PLAIN, [UNICODE_BREAKS])) as (_, http):
        response = await http.post(path, json={**body, "stream": True})
    assert response.status_code == 200
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    decoded = [json.loads(d) for d in data if d != "[DONE]"]
    assert "\u2028" in json.dumps(decoded, ensure_ascii=False)  # the text did come through, decoded back
