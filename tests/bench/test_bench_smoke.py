"""`mlx-trio bench` end to end: it starts our server on a tiny model, measures, reports, and stops it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from mlx_trio.bench.servers import ManagedServer
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

OUTPUT_TOKENS = 8


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it has exited all the same.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" in status.read_text()


def test_bench_runs_against_a_tiny_model_server_and_stops_it(tmp_path: Path) -> None:
    """A few agent requests at concurrency 1 and 2: all complete with exactly max_tokens (EOS suppressed),
    turn 2 resends turn 1, the table and JSON come out, and the server's pid is gone afterwards."""
    model = tiny_model(LLAMA)
    out, logs = tmp_path / "bench.json", tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "mlx_trio.bench", "--serve", "ours", "--model", str(model), "--workload", "agents",
         "--concurrency", "1,2", "--requests", "4", "--rounds", "1", "--output-tokens", str(OUTPUT_TOKENS),
         "--system-words", "30", "--task-words", "8", "--followup-words", "6", "--rate", "inf",
         "--out", str(out), "--log-dir", str(logs), "--no-progress"],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "| conc | server | ok/failed |" in done.stdout
    assert re.search(r"^\| 1 \| ours \| 4/0 \|", done.stdout, re.M) and re.search(r"^\| 2 \| ours \| 4/0 \|",
                                                                                  done.stdout, re.M)
    doc = json.loads(out.read_text())
    assert doc["meta"]["eos_ids"] == [2] and doc["meta"]["model"] == str(model)
    requests = [r for run in doc["runs"] for r in run["requests"]]
    assert len(requests) == 8 and all(r["ok"] for r in requests)
    assert all(r["completion_tokens"] == OUTPUT_TOKENS and r["finish_reason"] == "length" for r in requests)
    for run in doc["runs"]:
        by_turn = {(r["session_id"], r["turn"]): r["prompt_tokens"] for r in run["requests"]}
        assert all(by_turn[(s, 1)] > by_turn[(s, 0)] for s, _ in by_turn)
    assert all(s["output_tok_s"] > 0 and s["ttft_p50_s"] > 0 for s in doc["summaries"])
    pids = [int(p) for p in re.findall(r"# pid (\d+)", (logs / "ours.log").read_text())]
    assert len(pids) == 1 and _pid_gone(pids[0])


async def test_a_managed_server_that_died_is_restarted_on_a_new_port(tmp_path: Path) -> None:
    """ensure_up after a SIGKILL starts the server again; stop() leaves no process behind."""
    server = ManagedServer("ours", "ours", str(tiny_model(LLAMA)), tmp_path / "ours.log", startup_timeout_s=120)
    await server.start()
    try:
        first_pid = server.pid
        assert first_pid is not None
        os.kill(first_pid, 9)
        with trio.fail_after(10):
            while not server.exited():
                await trio.sleep(0.05)
        await server.ensure_up()
        assert server.restarts == 1 and server.pid != first_pid
        async with httpx.AsyncClient() as client:
            assert (await client.get(server.url + "/health")).status_code == 200
    finally:
        second_pid = server.pid
        server.stop()
    assert second_pid is not None and _pid_gone(second_pid) and _pid_gone(first_pid)
