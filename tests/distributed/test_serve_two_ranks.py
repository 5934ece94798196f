"""`mlx-trio serve` on 2 ranks over HTTP (CPU ring backend): the one-process text, each rank's heartbeat in
/v1/status, a hung follower reported by /health within its collective timeout, a killed follower
launched again with every stream resumed by the front to the one-process text, and a killed rank (either)
served from again, health and a greedy answer, within `RECOVERY_BOUND_S` (docs/scale-out.md "Recovery")."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from mlx_trio import open_engine
from mlx_trio.engine.distributed.heartbeat import HANG_AT_BEAT_ENV
from mlx_trio.testing.tiny_models import LLAMA, TinyModelSpec, tiny_model
from tests.distributed.served import two_rank_server
from tests.prompts import PROMPTS

# Slow: two processes that each load, shard and warm up (~30 s each on 2 cores). One recovery case runs in the
# default suite (issue #44: a killed rank 0 used to end the server): its bound is what CI must keep.
SLOW = pytest.mark.slow


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


@SLOW
async def test_four_concurrent_http_requests_on_two_ranks_give_the_one_process_text(tmp_path: Path) -> None:
    path = tiny_model(LLAMA)
    async with open_engine(str(path), batch=1) as engine:
        expected = [(await engine.complete(p, max_tokens=16)).text for p in PROMPTS[:4]]
    with two_rank_server(path, "--batch", "4", log=tmp_path / "serve.log") as (url, process):
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _complete(url, p), PROMPTS[:4]))
        assert got == expected
        deadline = time.monotonic() + 10  # a front's copy of the status is refreshed once read
        while (status := httpx.get(f"{url}/v1/status", timeout=10).json())["ranks"][1]["state"] != "up":
            assert time.monotonic() < deadline, status["ranks"]
            time.sleep(0.1)
        assert [(r["id"], r["backend"], r["state"]) for r in status["ranks"]] == [(0, "ring", "up"), (1, "ring", "up")]
        assert all(r["last_heartbeat"] is not None for r in status["ranks"])
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        process.terminate()
        assert process.wait(60) == 0  # rank 0 drained and stopped its follower


@SLOW
async def test_serve_pipeline_parallel_gives_the_one_process_text(tmp_path: Path) -> None:
    """`serve --pipeline-parallel 2` on a qwen2 model: 4 concurrent requests over HTTP, the one-process text."""
    path = tiny_model(TinyModelSpec("qwen2"))
    async with open_engine(str(path), batch=1) as engine:
        expected = [(await engine.complete(p, max_tokens=16)).text for p in PROMPTS[:4]]
    with two_rank_server(path, "--batch", "4", split="--pipeline-parallel", log=tmp_path / "serve.log") as (url, _):
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: _complete(url, p), PROMPTS[:4])) == expected


@SLOW
def test_a_hung_follower_is_reported_by_health_within_its_collective_timeout(tmp_path: Path) -> None:
    """Rank 1 blocks in its 3rd heartbeat (fault injection): rank 0's /health turns 503 and names the
    collective timeout; the HTTP server stays up to say so. Under mlx.launch, which cannot launch the
    ranks again, rank 0 stays so until it is restarted (under `--tensor-parallel` it would exit at once
    for its launcher to re-form the group: the killed-follower test below)."""
    path = tiny_model(LLAMA)
    env = {HANG_AT_BEAT_ENV: "3"}
    with two_rank_server(path, "--collective-timeout", "2", env=env, log=tmp_path / "serve.log",
                         mlx_launch=True) as (url, _):
        deadline = time.monotonic() + 120  # a bound on the test, not an assertion on time
        while (health := httpx.get(f"{url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "the hung follower was never reported"
            time.sleep(0.2)
        assert health.status_code == 503
        assert "did not answer the heartbeat within the 2 s collective timeout" in health.text
        status = httpx.get(f"{url}/v1/status", timeout=10).json()
        assert [r["state"] for r in status["ranks"]] == ["up", "lost"]


def _ranks_of(process) -> list[int]:
    """The pids of the rank processes `--tensor-parallel` launched, in rank order (Linux: /proc); the
    launcher's other children (the front processes) have no MLX_RANK."""
    ranks: dict[int, int] = {}
    out = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        rank = next((int(v.split(b"=")[1]) for v in env if v.startswith(b"MLX_RANK=")), None)
        if rank is not None:
            ranks[rank] = pid
    return [ranks[r] for r in sorted(ranks)]


@attrs.frozen
class Stream:
    """One client's streamed request: its wire API, prompt and sampling (OpenAI chat bans the EOS, as the
    one-process run does; Anthropic has no logit_bias, so its prompts are ones that run long greedily)."""

    api: str  # "chat" or "messages"
    prompt: str
    sampling: dict[str, Any]


def _read_stream(url: str, stream: Stream, max_tokens: int, no_eos: dict[int, float],
                 streaming: threading.Barrier) -> tuple[str, int]:
    """Send `stream` once (no retry: the server must finish it) and read it to its end; (text, completion
    tokens). Fails on an error event, an HTTP error, or a stream that does not end as its API ends one."""
    messages = [{"role": "user", "content": stream.prompt}]
    if stream.api == "chat":
        path = "/v1/chat/completions"
        body = {"messages": messages, "max_tokens": max_tokens, "stream": True, **stream.sampling,
                "stream_options": {"include_usage": True},
                "logit_bias": {str(token): bias for token, bias in no_eos.items()}}
    else:
        path = "/v1/messages"
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "stream": True, **stream.sampling}
    text, tokens, ended, waited = "", None, False, False
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=240) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                ended = True
                continue
            payload = json.loads(line.removeprefix("data: "))
            assert "error" not in payload, payload
            if stream.api == "chat":
                if payload.get("usage"):
                    tokens = payload["usage"]["completion_tokens"]
                text += "".join(c["delta"].get("content") or "" for c in payload["choices"])
            elif payload["type"] == "content_block_delta":
                text += payload["delta"]["text"]
            elif payload["type"] == "message_delta":
                tokens = payload["usage"]["output_tokens"]
            elif payload["type"] == "message_stop":
                ended = True
            if not waited and len(text) > 8:  # a few tokens in: ready for the kill
                waited = True
                streaming.wait(timeout=240)
    assert ended, f"{stream.api} stream did not end: {text[-80:]!r}"
    assert tokens is not None
    return text, tokens


def _sessions(status: dict[str, Any]) -> int:
    """How many session actors run in the supervision tree of /v1/status."""
    def find(node: dict[str, Any]) -> dict[str, Any] | None:
        if node.get("id") == "sessions":
            return node
        return next((found for child in node.get("children", []) if (found := find(child)) is not None), None)

    sessions = find(status["tree"])
    assert sessions is not None
    return len(sessions.get("children", []))


@SLOW
async def test_a_killed_follower_is_launched_again_and_every_stream_resumes_with_the_one_process_text(
        tmp_path: Path) -> None:
    """SIGKILL rank 1 while 4 streams decode on 2 ranks (--batch 4): OpenAI chat and Anthropic messages,
    greedy and one seeded sampled. The launcher starts both ranks again, and the front process, which
    outlives them, resumes every stream on the new rank 0 from the tokens its client already had: each
    client sends its request once and reads one response, whose text and token count are the one-process
    ones. Meanwhile the front's /health is 503; after, the new group holds no KV, no row and no session."""
    path = tiny_model(LLAMA)
    max_tokens = 1500
    streams = [Stream("chat", PROMPTS[0], {"temperature": 0}),
               Stream("chat", PROMPTS[2], {"temperature": 1.0, "seed": 7}),
               Stream("messages", PROMPTS[3], {"temperature": 0}),
               Stream("messages", PROMPTS[1], {"temperature": 0})]
    async with open_engine(str(path), batch=1) as engine:
        no_eos = {token: -100.0 for token in engine.actors.lane.model.eos_token_ids}
        expected = []
        for stream in streams:
            done = await engine.complete([{"role": "user", "content": stream.prompt}], max_tokens=max_tokens,
                                         **stream.sampling, **({"logit_bias": no_eos} if stream.api == "chat" else {}))
            expected.append((done.text, done.usage.completion_tokens))
    # Long enough that the kill, sent once every stream has its first tokens, lands while all 4 still decode.
    assert all(tokens > 1000 for _, tokens in expected), expected
    # A generous heartbeat deadline: on a loaded 2-core machine a step can be slow, and only the kill
    # must lose the group (a killed peer is seen at the next collective, not at the deadline).
    with two_rank_server(path, "--batch", "4", "--collective-timeout", "120", log=tmp_path / "serve.log") \
            as (url, process):
        first_ranks = _ranks_of(process)
        assert len(first_ranks) == 2
        streaming = threading.Barrier(len(streams) + 1)
        with ThreadPoolExecutor(len(streams)) as pool:
            pending = [pool.submit(_read_stream, url, s, max_tokens, no_eos, streaming) for s in streams]
            streaming.wait(timeout=240)  # every stream has its first tokens
            os.kill(first_ranks[1], signal.SIGKILL)
            deadline = time.monotonic() + 120  # a bound on the test, not an assertion on time
            while (health := httpx.get(f"{url}/health", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline, "the front's /health never saw the engine go"
                time.sleep(0.05)
            assert health.json()["status"] == "unavailable"
            got = [f.result() for f in pending]
        assert got == expected
        ranks = _ranks_of(process)
        assert len(ranks) == 2 and not set(ranks) & set(first_ranks)  # a new generation of both ranks
        stats = httpx.get(f"{url}/stats", timeout=10).json()["batch"]
        assert (stats["kv_bytes"], stats["active_rows"], stats["pending_rows"]) == (0, 0, 0)
        status = httpx.get(f"{url}/v1/status", timeout=10).json()
        assert [r["state"] for r in status["ranks"]] == ["up", "up"] and _sessions(status) == 0
        process.terminate()
        assert process.wait(60) == 0
    log = (tmp_path / "serve.log").read_text(encoding="utf-8")
    assert "rank 1 (pid" in log and "starting its 2 ranks again" in log
    assert len(re.findall(r"resuming after \d+ chunk", log)) == len(streams)  # the front resumed each once


# What the recovery test below requires: from a rank's SIGKILL to /health 200 and a correct greedy answer,
# on the tiny Llama over the CPU ring. Measured on the 2-core CI box, shared: 7 to 14 s (the new ranks'
# imports and the model's load; the launcher itself reacts within a poll), 10 to 19 s for a hang with a
# 5 s collective timeout. docs/scale-out.md "Recovery".
RECOVERY_BOUND_S = 60.0


@pytest.mark.parametrize(("victim", "how"), [pytest.param(1, signal.SIGKILL, id="follower", marks=SLOW),
                                             pytest.param(0, signal.SIGKILL, id="rank0"),
                                             pytest.param(1, signal.SIGSTOP, id="hung-follower", marks=SLOW)])
async def test_a_killed_rank_is_served_from_again_within_the_bound_and_its_stream_resumes(
        tmp_path: Path, victim: int, how: signal.Signals) -> None:
    """SIGKILL one rank (issue #44: rank 0's death used to end the server), or stop a follower (SIGSTOP: a
    hang, which no process exit shows; rank 0's heartbeat deadline does), while a greedy stream decodes:
    the stream ends as the one-process one with no error, and /health is 200 and a greedy completion is the
    one-process text again within `RECOVERY_BOUND_S` (for the hang, after its collective timeout)."""
    path = tiny_model(LLAMA)
    stream = Stream("chat", PROMPTS[0], {"temperature": 0})
    async with open_engine(str(path), batch=1) as engine:
        no_eos = {token: -100.0 for token in engine.actors.lane.model.eos_token_ids}
        done = await engine.complete([{"role": "user", "content": stream.prompt}], max_tokens=600,
                                     temperature=0, logit_bias=no_eos)
        expected = (done.text, done.usage.completion_tokens)
        short = (await engine.complete(PROMPTS[1], max_tokens=16)).text
    timeout = "5" if how == signal.SIGSTOP else "120"  # only the hang needs the deadline
    with two_rank_server(path, "--collective-timeout", timeout, log=tmp_path / "serve.log") as (url, process):
        ranks = _ranks_of(process)
        streaming = threading.Barrier(2)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_read_stream, url, stream, 600, no_eos, streaming)
            streaming.wait(timeout=240)
            killed_at = time.monotonic()
            os.kill(ranks[victim], how)
            while True:
                assert time.monotonic() - killed_at < RECOVERY_BOUND_S, f"not back within {RECOVERY_BOUND_S:g} s"
                now = _ranks_of(process)  # both ranks of the next generation (none of the old is left)
                try:
                    healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy and len(now) == 2 and set(now).isdisjoint(ranks):
                    assert _complete(url, PROMPTS[1]) == short
                    elapsed = time.monotonic() - killed_at
                    break
                time.sleep(0.1)
            assert elapsed < RECOVERY_BOUND_S
            print(f"rank {victim} {how.name}: health 200 and a greedy answer after {elapsed:.1f} s")
            assert pending.result() == expected
