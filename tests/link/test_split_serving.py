"""`serve --api-server-count 2` on the tiny Llama: the HTTP stack in two front processes, the engine here.

The same goldens as the in-process server (tests/http/test_live.py), through the
link; disconnects free KV in the engine; a front killed outright is started
again while the other serves on; an engine fault armed through a front is
resumed from as in one process; bad input is the same 400; a /v1/responses
chain continues through either front (one store, in the engine's process).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.http.http_helpers import CLIENT_TIMEOUT_S, ServerThread, assert_openai_error, tiny_engine_config
from tests.http.test_live import CONCURRENT_CASES

from mlx_trio.http import ServerConfig
from tests.goldens import golden

FRONTS = 2


@pytest.fixture(scope="module")
def split_server() -> Iterator[ServerThread]:
    config = ServerConfig(port=0, api_server_count=FRONTS, enable_fault_injection=True)
    with ServerThread(tiny_engine_config(), config) as server:
        yield server


@pytest.fixture()
def http(split_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=split_server.url, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def _stream_case(url: str, case: dict[str, Any], start: threading.Barrier | None = None) -> tuple[str, str | None]:
    chat = isinstance(case["prompt"], list)
    body = {**case["params"], "stream": True, "temperature": case["params"].get("temperature", 0.0),
            **({"messages": case["prompt"]} if chat else {"prompt": case["prompt_ids"]})}
    text, finish = "", None
    # A client of its own each: its own connection, so the kernel may hand it to either front.
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        if start is not None:
            start.wait()
        with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line.removeprefix("data: "))["choices"]:
                        text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        finish = choice.get("finish_reason") or finish
    return text, finish


def _pool(server: ServerThread) -> Any:
    return server.server


def test_eight_concurrent_streams_through_the_fronts_are_their_goldens(split_server: ServerThread) -> None:
    cases = [golden("llama", name) for name in CONCURRENT_CASES]
    start = threading.Barrier(len(cases))
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: _stream_case(split_server.url, case, start), cases))
    assert results == [(case["text"], case["finish_reason"]) for case in cases]


def test_status_shows_the_engine_tree_with_the_answering_front(http: httpx.Client) -> None:
    tree = http.get("/v1/status").json()["tree"]
    ids = [child["id"] for child in tree["children"]]
    # The engine's children, then the answering front's own (its link and its http, as in one process).
    assert ids == ["engine", "sessions", "link", "engine-link", "http"]
    assert tree["children"][4]["front"].startswith("front-")
    deadline = time.monotonic() + 20  # the front's copy of the engine's status is refreshed as it is read
    while http.get("/v1/status").json()["tree"]["children"][2]["stats"]["fronts"] != FRONTS + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)  # every front, and the launcher's watch


def test_a_disconnect_frees_the_row_and_its_kv_in_the_engine(http: httpx.Client) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert [line for line in itertools.islice(lines, 12) if line.startswith("data: {")]
    deadline = time.monotonic() + 15
    while True:
        batch = http.get("/stats").json()["batch"]
        if (batch["active_rows"], batch["kv_bytes"]) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (batch["active_rows"], batch["kv_bytes"]) == (0, 0)


def test_bad_input_is_the_same_400_naming_the_field(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "temperature": -1})
    assert_openai_error(response, 400, param="temperature")


def test_an_engine_fault_armed_through_a_front_is_resumed_from(split_server: ServerThread,
                                                                http: httpx.Client) -> None:
    case = golden("llama", "greedy_raw")
    armed = http.post("/v1/admin/faults", json={"actor": "decode-step", "kind": "raise"})
    assert armed.status_code == 200, armed.text
    assert _stream_case(split_server.url, case) == (case["text"], case["finish_reason"])
    # A front's copy of the engine's status is refreshed as it is read, and each front has its own: a
    # second read may reach the other front's older copy, so the read that saw the restart is the one judged.
    deadline, restarts = time.monotonic() + 20, 0
    while restarts < 1 and time.monotonic() < deadline:
        restarts = _find(http.get("/v1/status").json()["tree"], "decode-step")["restarts"]
        time.sleep(0.05)
    assert restarts >= 1


def test_a_killed_front_is_started_again_and_the_other_serves_on(split_server: ServerThread,
                                                                 http: httpx.Client) -> None:
    pool = _pool(split_server).pool
    before, restarts = pool.pids(), pool.restarts
    assert len(before) == FRONTS
    os.kill(before[0], signal.SIGKILL)
    case = golden("llama", "greedy_chat")
    # Every request is answered meanwhile (by the other front, or by the new one), each its golden.
    for _ in range(6):
        assert _stream_case(split_server.url, case) == (case["text"], case["finish_reason"])
    deadline = time.monotonic() + 30
    while (len(pool.pids()) < FRONTS or pool.restarts == restarts) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = pool.pids()
    assert pool.restarts == restarts + 1 and len(after) == FRONTS and before[0] not in after


def test_a_killed_engine_process_is_started_again_and_its_streams_resume(split_server: ServerThread,
                                                                         http: httpx.Client) -> None:
    """SIGKILL the engine's process mid-stream: the client's stream goes on, to exactly the unbroken text."""
    launcher = _pool(split_server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}

    def texts(kill_after: int | None) -> str:
        text, chunks = "", 0
        with httpx.Client(base_url=split_server.url, timeout=CLIENT_TIMEOUT_S) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        text += "".join(c.get("text") or "" for c in json.loads(line.removeprefix("data: "))["choices"])
                        chunks += 1
                        if chunks == kill_after:
                            os.kill(launcher.engine_pid, signal.SIGKILL)
        return text

    unbroken = texts(None)
    first_engine = launcher.engine_pid
    assert texts(kill_after=20) == unbroken
    assert launcher.engine_pid not in (None, first_engine) and launcher.keeper.generation == 2
    # The front's health is its last reading of the engine's (each front keeps its own): it turns 200 within a poll.
    deadline = time.monotonic() + 20
    while (status := http.get("/health").status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 200


def _find(node: dict[str, Any], actor: str) -> dict[str, Any]:
    if node.get("id") == actor:
        return node
    for child in node.get("children", []):
        found = _find(child, actor)
        if found:
            return found
    return {}


def _fresh(url: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request on a connection of its own: the kernel may hand it to either front."""
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        return client.request(method, path, **kwargs)


def _answering_front(url: str) -> str:
    return _fresh(url, "GET", "/v1/status").json()["tree"]["children"][-1]["front"]  # its http child, last


def test_a_response_chain_continues_through_either_front(split_server: ServerThread) -> None:
    """One /v1/responses store for both fronts: every turn of a chain, each on a fresh connection, finds the
    last (streamed turns too: the put is in before the stream's end), its GET and input_items read back through
    any front, and the chained prompt is the explicit history's, token for token (the context carried)."""
    url = split_server.url
    fronts: set[str] = set()
    for _ in range(100):  # the kernel spreads fresh connections over both fronts (else this test shows nothing)
        fronts.add(_answering_front(url))
        if len(fronts) == FRONTS:
            break
    assert len(fronts) == FRONTS
    base = {"model": "m", "temperature": 0, "max_output_tokens": 4}
    history: list[dict[str, Any]] = []
    previous: str | None = None
    for turn in range(8):
        user = {"type": "message", "role": "user", "content": f"Turn {turn}: say more."}
        body = {**base, "input": [user], **({"previous_response_id": previous} if previous else {})}
        if turn % 2:
            streamed = _fresh(url, "POST", "/v1/responses", json={**body, "stream": True})
            assert streamed.status_code == 200, streamed.text
            done = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
                    if line.startswith("data: ")][-1]
            assert done["type"] in ("response.completed", "response.incomplete"), done
            response = done["response"]
        else:
            answer = _fresh(url, "POST", "/v1/responses", json=body)
            assert answer.status_code == 200, answer.text
            response = answer.json()
        explicit = _fresh(url, "POST", "/v1/responses", json={**base, "input": [*history, user], "store": False})
        assert explicit.status_code == 200, explicit.text
        assert response["usage"]["input_tokens"] == explicit.json()["usage"]["input_tokens"]
        assert response["output"] == [] or response["output"][0]["content"] == explicit.json()["output"][0]["content"]
        assert _fresh(url, "GET", f"/v1/responses/{response['id']}").json() == response
        items = _fresh(url, "GET", f"/v1/responses/{response['id']}/input_items").json()["data"]
        assert [item["content"] for item in items] == [[{"type": "input_text", "text": user["content"]}]]
        history += [user, *response["output"]]
        previous = response["id"]
    deleted = _fresh(url, "DELETE", f"/v1/responses/{previous}")
    assert deleted.status_code == 200
    for _ in range(4):  # gone through every front
        assert_openai_error(_fresh(url, "GET", f"/v1/responses/{previous}"), 404)
