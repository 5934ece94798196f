"""`mlx-trio serve` on 2 ranks over HTTP (CPU ring backend): the one-process text, each rank's heartbeat in
/v1/status, a hung follower reported by /health within its collective timeout, and a killed follower
launched again with every stream finishing as in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlx_trio import open_engine
from mlx_trio.engine.distributed.heartbeat import HANG_AT_BEAT_ENV
from mlx_trio.testing.tiny_models import LLAMA, TinyModelSpec, tiny_model
from tests.distributed.served import two_rank_server
from tests.prompts import PROMPTS

pytestmark = pytest.mark.slow  # two processes that each load, shard and warm up: ~30 s each on 2 cores


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


async def test_four_concurrent_http_requests_on_two_ranks_give_the_one_process_text(tmp_path: Path) -> None:
    path = tiny_model(LLAMA)
    async with open_engine(str(path), batch=1) as engine:
        expected = [(await engine.complete(p, max_tokens=16)).text for p in PROMPTS[:4]]
    with two_rank_server(path, "--batch", "4", log=tmp_path / "serve.log") as (url, process):
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _complete(url, p), PROMPTS[:4]))
        assert got == expected
        status = httpx.get(f"{url}/v1/status", timeout=10).json()
        assert [(r["id"], r["backend"], r["state"]) for r in status["ranks"]] == [(0, "ring", "up"), (1, "ring", "up")]
        assert all(r["last_heartbeat"] is not None for r in status["ranks"])
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        process.terminate()
        assert process.wait(60) == 0  # rank 0 drained and stopped its follower


async def test_serve_pipeline_parallel_gives_the_one_process_text(tmp_path: Path) -> None:
    """`serve --pipeline-parallel 2` on a qwen2 model: 4 concurrent requests over HTTP, the one-process text."""
    path = tiny_model(TinyModelSpec("qwen2"))
    async with open_engine(str(path), batch=1) as engine:
        expected = [(await engine.complete(p, max_tokens=16)).text for p in PROMPTS[:4]]
    with two_rank_server(path, "--batch", "4", split="--pipeline-parallel", log=tmp_path / "serve.log") as (url, _):
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: _complete(url, p), PROMPTS[:4])) == expected


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
    """The pids of the rank processes `--tensor-parallel` launched, in rank order (Linux: /proc)."""
    def rank(pid: int) -> int:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return int(next(v for v in env if v.startswith(b"MLX_RANK=")).split(b"=")[1])

    out = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout
    return sorted((int(p) for p in out.split()), key=rank)


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 240  # a bound on the test (the ranks load again), not an assertion on time
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass  # between two launches nothing listens
        assert time.monotonic() < deadline, "the group never came back"
        time.sleep(0.5)


def _stream_until_done(url: str, prompt: str, max_tokens: int, logit_bias: dict[int, float],
                       streaming: threading.Barrier, attempts: list[str]) -> str:
    """Stream a greedy completion; on an error (in-band, a 503, a cut connection) wait until the server
    is healthy again and send it again, as a client of a retryable error does. Its text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(token): bias for token, bias in logit_bias.items()}}
    first = True
    while True:
        text, done, error = "", False, None
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}"
                else:
                    for line in response.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            payload = json.loads(line.removeprefix("data: "))
                            if "error" in payload:
                                error = payload["error"].get("code") or "error"
                                continue
                            text += "".join(c.get("text") or "" for c in payload["choices"])
                            if first and len(text) > 8:  # a few tokens in: ready for the kill
                                first = False
                                streaming.wait(timeout=240)
        except httpx.TransportError as exc:
            error = type(exc).__name__
        if done and error is None:
            return text
        attempts.append(error or "no [DONE]")
        _wait_healthy(url)


async def test_a_killed_follower_is_launched_again_and_every_stream_finishes_with_the_one_process_text(
        tmp_path: Path) -> None:
    """SIGKILL rank 1 while 4 greedy streams decode on 2 ranks (--batch 4): rank 0 loses the group, ends
    each stream with a retryable error, drains and exits; the launcher starts both ranks again on the
    same port. Every client, sending its request again, gets the one-process text, and the new group
    holds no KV once they are done. A group cannot be re-formed inside a running rank (mlx_trio/local_group.py
    says why), so the streams restart from their prompt rather than resume."""
    path = tiny_model(LLAMA)
    # The EOS banned, every stream runs to its 1500 tokens: long enough that the kill, sent once every
    # stream has its first tokens, lands while all 4 still decode.
    max_tokens, prompts = 1500, PROMPTS[:4]
    async with open_engine(str(path), batch=1) as engine:
        no_eos = {token: -100.0 for token in engine.actors.lane.model.eos_token_ids}
        expected = [(await engine.complete(p, max_tokens=max_tokens, logit_bias=no_eos)).text for p in prompts]
    # A generous heartbeat deadline: on a loaded 2-core machine a step can be slow, and only the kill
    # must lose the group (a killed peer is seen at the next collective, not at the deadline).
    with two_rank_server(path, "--batch", "4", "--collective-timeout", "120", log=tmp_path / "serve.log") \
            as (url, process):
        first_ranks = _ranks_of(process)
        assert len(first_ranks) == 2
        attempts: list[str] = []
        streaming = threading.Barrier(len(prompts) + 1)
        with ThreadPoolExecutor(len(prompts)) as pool:
            pending = [pool.submit(_stream_until_done, url, p, max_tokens, no_eos, streaming, attempts)
                       for p in prompts]
            streaming.wait(timeout=240)  # every stream has its first tokens
            os.kill(first_ranks[1], signal.SIGKILL)
            got = [f.result() for f in pending]
        assert got == expected
        assert len(attempts) >= len(prompts), attempts  # every stream was cut by the kill and sent again
        ranks = _ranks_of(process)
        assert len(ranks) == 2 and not set(ranks) & set(first_ranks)  # a new generation of both ranks
        stats = httpx.get(f"{url}/stats", timeout=10).json()["batch"]
        assert (stats["kv_bytes"], stats["active_rows"], stats["pending_rows"]) == (0, 0, 0)
        status = httpx.get(f"{url}/v1/status", timeout=10).json()
        assert [r["state"] for r in status["ranks"]] == ["up", "up"]
        process.terminate()
        assert process.wait(60) == 0
    assert "launching its 2 ranks again" in (tmp_path / "serve.log").read_text(encoding="utf-8")
