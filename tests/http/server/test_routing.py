"""Odd paths get an OpenAI-shaped 404, never a redirect, and leave the keep-alive connection usable."""

from __future__ import annotations

import pytest
import trio
from tests.http.http_helpers import assert_openai_error, serve_fake

# Well past hypercorn's app queue (10 body chunks), so an unread body would block the connection.
LARGE = b'{"messages": [{"role": "user", "content": "' + b"x" * 2_000_000 + b'"}]}'
# Generous: a hang is the failure, any normal run answers in well under a second.
HANG_GUARD_S = 30


@pytest.mark.parametrize(("path", "status"), [("//v1/chat/completions", 200), ("/v1//chat/completions", 404),
                                              ("/v1/chat/completions/", 404)])
async def test_an_odd_path_is_served_or_a_404_and_the_connection_serves_the_next(path: str, status: int) -> None:
    """Leading slashes are one (the router reads the path so); any other odd path is an unserved one."""
    async with serve_fake(max_body_bytes=4_000_000) as (server, http):
        with trio.fail_after(HANG_GUARD_S):
            # The whole URL: httpx reads a relative "//v1/..." as a host.
            response = await http.post(server.url + path, content=LARGE, headers={"content-type": "application/json"})
            if status == 404:
                assert "no endpoint POST" in assert_openai_error(response, 404, code="not_found")["message"]
            else:
                assert response.status_code == 200 and response.json()["object"] == "chat.completion"
            follow = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert follow.status_code == 200
