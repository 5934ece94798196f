"""The Trio thread's CPU per streamed token of `mlx-trio serve` under c streaming chat clients (issue 20, point 4).

Usage:
    python benchmarks/trio_thread_cpu.py                       # tiny model, --batch 64, c=64 and c=8
    python benchmarks/trio_thread_cpu.py --concurrency 64 --rounds 3 --json out.json
    python benchmarks/trio_thread_cpu.py --profile /tmp/trio.txt   # where the Trio thread's time goes
    python benchmarks/trio_thread_cpu.py --src /tmp/other-checkout  # the server from another checkout
    python benchmarks/trio_thread_cpu.py --micro [--src ...]         # one event's own work, no sockets
    python benchmarks/trio_thread_cpu.py --http-only [--src ...]     # the HTTP layer alone: no model, no engine

The server runs in its own process (`python -m mlx_trio.cli serve`, tiny random
model unless `--model`), and so do the clients (`--client`: c asyncio tasks
with httpx, each streaming chat completions of `--tokens` tokens, EOS biased
away), so neither shares the server's GIL. After a warm-up run, each measured
run reads the server's threads' CPU time from /proc/PID/task/TID/stat before
and after it; the Trio thread is the main thread (TID = PID). Tokens are the
usage chunks' `completion_tokens`, summed. The table shows, per concurrency,
the median over `--rounds` runs of the Trio thread's µs of CPU per streamed
token, the other threads' (the lease thread, MLX's, the worker pool), SSE
events per token, and aggregate tok/s.

`--micro` measures instead, in a process of its own, what one streamed chat
event costs the Trio thread without any socket: detokenize a message of
`--micro-tokens` tokens, route, render and encode it (`time.thread_time`,
the minimum of 7 repeats), the part of an event's work that is ours.

`--http-only` serves the real app on hypercorn over a stand-in engine
(`FakeEngine` below: no model, no actors, no lease thread) whose streams
all get their next event of `--tokens-per-event` tokens at once every
`--step-ms`, as a decode report wakes a batch's rows: the Trio thread's CPU
per event and per token of the HTTP layer alone (request handling, routing,
rendering, the ASGI write), without the GIL contention of a lease thread.

`--profile FILE` samples the server's Trio thread's stack every millisecond and
writes where its busy time goes to FILE when the server stops (`serve_profiled`);
CPU numbers of a sampled run are inflated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# ---- the client process ------------------------------------------------------------------------------

async def _one(client: Any, url: str, body: dict[str, Any]) -> tuple[int, int]:
    """One streamed request: (completion tokens from its usage chunk, content events)."""
    tokens = events = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                events += 1
    return tokens, events


async def _clients(url: str, concurrency: int, requests: int, tokens: int, eos: list[int]) -> dict[str, int]:
    import httpx

    body = {"model": "default", "messages": [{"role": "user", "content": "Tell me a long story about a cat."}],
            "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": {str(e): -100 for e in eos}}
    queue = list(range(requests))
    total = [0, 0]

    async def worker(client: Any) -> None:
        while queue:
            queue.pop()
            got, events = await _one(client, url, body)
            total[0] += got
            total[1] += events

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return {"tokens": total[0], "events": total[1]}


def client_main(args: argparse.Namespace) -> None:
    result = asyncio.run(_clients(args.url, args.concurrency, args.requests, args.tokens, args.eos))
    print(json.dumps(result))


# ---- the driver --------------------------------------------------------------------------------------

def run_clients(url: str, concurrency: int, requests: int, tokens: int, eos: list[int]) -> dict[str, int]:
    argv = [sys.executable, __file__, "--client", "--url", url, "--concurrency", str(concurrency),
            "--requests", str(requests), "--tokens", str(tokens), "--eos", *map(str, eos)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited during startup")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not get ready")


def measure(pid: int, url: str, concurrency: int, requests: int, tokens: int, eos: list[int]) -> dict[str, Any]:
    # Imported here: the child processes of --micro and --profile import another checkout's package.
    from mlx_trio.profiling.thread_cpu import tasks

    before, t0 = tasks(pid), time.perf_counter()
    got = run_clients(url, concurrency, requests, tokens, eos)
    after, wall = tasks(pid), time.perf_counter() - t0

    def spent(tid: int) -> float:
        return after[tid].cpu_s - (before[tid].cpu_s if tid in before else 0.0)

    trio_s = spent(pid)
    other_s = sum(spent(tid) for tid in after if tid != pid)
    n = max(got["tokens"], 1)
    return {"concurrency": concurrency, "tokens": got["tokens"], "events": got["events"], "wall_s": wall,
            "trio_us_per_token": 1e6 * trio_s / n, "other_us_per_token": 1e6 * other_s / n,
            "events_per_token": got["events"] / n, "tok_s": got["tokens"] / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: the tiny random Llama)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--concurrency", default="64,8", help="a comma list (default: %(default)s)")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", help="run the server from this checkout (PYTHONPATH)")
    parser.add_argument("--profile", help="sample the server's Trio thread's stacks; the report goes to this file")
    parser.add_argument("--json", help="write the runs here")
    parser.add_argument("--micro", action="store_true", help="one event's own work, without sockets")
    parser.add_argument("--micro-tokens", type=int, default=3, help="tokens per event for --micro")
    parser.add_argument("--http-only", action="store_true", help="the HTTP layer over a stand-in engine, no model")
    parser.add_argument("--tokens-per-event", type=int, default=3, help="tokens per event for --http-only")
    parser.add_argument("--step-ms", type=float, default=4.0, help="ms between events for --http-only")
    # The client process's own arguments.
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--eos", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    if sys.argv[1:2] == ["--micro-child"]:  # the process of --micro, importing the checkout on PYTHONPATH
        return micro(int(sys.argv[2]))
    if sys.argv[1:2] == ["--serve-fake"]:  # the server process of --http-only
        return serve_fake(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    if sys.argv[1:2] == ["--serve-profiled"]:  # the server process of --profile: the rest is serve's argv
        return serve_profiled(sys.argv[2], sys.argv[3:])
    args = parser.parse_args()
    if args.client:
        args.concurrency = int(args.concurrency)
        return client_main(args)

    if args.micro:
        src = args.src or str(Path(__file__).resolve().parents[1])
        subprocess.run([sys.executable, __file__, "--micro-child", str(args.micro_tokens)],
                       env={**os.environ, "PYTHONPATH": src}, cwd=src, check=True)
        return None
    from mlx_trio.bench.servers import free_port
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model

    model = args.model or str(tiny_model(LLAMA))
    config = json.loads((Path(model) / "config.json").read_text())
    eos_ids = config.get("eos_token_id", [])
    eos = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    if not eos:  # the tiny models name theirs only in the tokenizer
        added = json.loads((Path(model) / "tokenizer.json").read_text())["added_tokens"]
        eos = [t["id"] for t in added if t["content"] in ("<|im_end|>", "<|endoftext|>")]
    if args.http_only:
        eos = []  # the stand-in takes no logit_bias ids of a real vocabulary
    port = free_port()
    serve = ["serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--batch", str(args.batch),
             "--log-level", "WARNING"]
    argv = ([sys.executable, __file__, "--serve-profiled", args.profile, *serve] if args.profile
            else [sys.executable, "-m", "mlx_trio.cli", *serve])
    if args.http_only:
        argv = [sys.executable, __file__, "--serve-fake", str(port), str(args.tokens_per_event), str(args.step_ms)]
    # The checkout this script is in (or --src) is the one the server imports, whatever is installed.
    src = args.src or str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": src}, cwd=src)
    url = f"http://127.0.0.1:{port}"
    runs: list[dict[str, Any]] = []
    try:
        wait_ready(url, proc)
        levels = [int(c) for c in args.concurrency.split(",")]
        run_clients(url + "/v1/chat/completions", max(levels), max(levels), args.tokens, eos)  # warm-up
        if args.profile:
            proc.send_signal(signal.SIGUSR1)
        for _ in range(args.rounds):
            for c in levels:
                runs.append(measure(proc.pid, url + "/v1/chat/completions", c, max(c * args.requests_per_client, 96),
                                    args.tokens, eos))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    print(f"\n{'c':>4} {'trio µs/tok':>12} {'other µs/tok':>13} {'events/tok':>11} {'tok/s':>8}")
    for c in sorted({r["concurrency"] for r in runs}, reverse=True):
        mine = [r for r in runs if r["concurrency"] == c]

        def med(key: str, rows: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in rows)

        print(f"{c:>4} {med('trio_us_per_token'):>12.1f} {med('other_us_per_token'):>13.1f} "
              f"{med('events_per_token'):>11.2f} {med('tok_s'):>8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def micro(per_event: int) -> None:
    """Print the Trio-thread µs of one chat event's own work: detokenize, route, render, encode (no socket)."""
    from mlx_lm.tokenizer_utils import load

    from mlx_trio.engine.model.text import TextStream
    from mlx_trio.http.completion.output_router import OutputRouter
    from mlx_trio.http.openai.objects import ResponseShape
    from mlx_trio.http.openai.render import CompletionRenderer
    from mlx_trio.output_format import PLAIN
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model

    tokenizer = load(tiny_model(LLAMA))
    ids = tokenizer.encode("The capital of France is Paris. It has a river, many bridges and cafés. " * 40,
                           add_special_tokens=False)

    def one_stream() -> None:
        text, router = TextStream(tokenizer.detokenizer), OutputRouter(PLAIN)
        renderer = CompletionRenderer(ResponseShape.new(chat=True, model="tiny"), include_usage=True)
        for start in range(0, len(ids), per_event):
            part = ids[start:start + per_event]
            if getattr(text, "batches", False):  # an older checkout has no add_many
                piece = text.add_many(part)
            else:
                piece = "".join(text.add(token).text for token in part)
            b"".join(renderer.delta(router.feed(piece, len(part)), None))

    runs = []
    for _ in range(7):
        start_s = time.thread_time()
        for _ in range(5):
            one_stream()
        runs.append(1e6 * (time.thread_time() - start_s) / (5 * len(ids)))
    print(f"{per_event} tokens per event: {min(runs):.2f} µs per token, {min(runs) * per_event:.1f} µs per event")


class FakeEngine:
    """The surface of `Engine` the HTTP layer uses (`http.server.state.EngineLike`), streaming words "w0 w1 ...".

    Every stream waits on one shared tick (`step_s`), so all of them get their next event
    together, `per_event` tokens each, as a decode report wakes every row of a batch at once.
    """

    def __init__(self, per_event: int, step_s: float) -> None:
        from mlx_trio.output_format import PLAIN
        from mlx_trio.supervision.faults import Faults

        self.faults = Faults()
        self.group_lost = None
        self.output_format = PLAIN
        self.context_length = 1 << 20
        self.model_id = "fake"
        self._per_event, self._step_s = per_event, step_s
        self._tick: Any = None

    def health(self) -> tuple[bool, str]:
        return True, "ok"

    def status(self) -> dict[str, Any]:
        return {"tree": {"id": "root", "state": "running", "children": []}, "model": "fake", "counters": {}}

    def served_adapters(self) -> tuple[str, ...]:
        return ()

    def count_tokens(self, prompt: Any, **_: Any) -> int:
        return 8

    async def prepare_off_loop(self, prompt: Any, **sampling: Any) -> Any:
        import types

        return types.SimpleNamespace(prompt_ids=(0,) * 8, max_tokens=sampling.get("max_tokens") or 16)

    async def ticks(self) -> None:
        import trio

        while True:
            self._tick = trio.Event()
            await trio.sleep(self._step_s)
            self._tick.set()

    async def stream(self, request: Any, **_: Any) -> Any:
        from mlx_trio.events import Finished, PromptProgress, TextDelta, Usage

        yield PromptProgress(8, 8)
        n = request.max_tokens
        for start in range(0, n, self._per_event):
            await self._tick.wait()
            ids = tuple(range(start, min(n, start + self._per_event)))
            yield TextDelta("".join(f" w{i}" for i in ids), ids)
        yield Finished("length", Usage(8, n))


def serve_fake(port: int, per_event: int, step_ms: float) -> None:
    """The process of `--http-only`: `HttpServer` over `FakeEngine` on `port`, until SIGINT."""
    import trio

    from mlx_trio.http.server.config import ServerConfig
    from mlx_trio.http.server.http_server import HttpServer

    async def main() -> None:
        engine = FakeEngine(per_event, step_ms / 1000)
        server = HttpServer(ServerConfig(host="127.0.0.1", port=port), engine)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.ticks)
            await nursery.start(server.run)

    try:
        trio.run(main)
    except* KeyboardInterrupt:  # the driver's SIGINT: the end of the run
        pass


def serve_profiled(out: str, argv: list[str]) -> None:
    """`mlx-trio serve` with a stack sampler on the main (Trio) thread; a report goes to `out` when it stops.

    From the driver's SIGUSR1 on, a daemon thread reads `sys._current_frames()` every millisecond (cProfile's
    per-call cost distorts a Trio server too much to be useful). Samples whose
    innermost frame waits in the selector are idle and not counted. The report
    lists, per function, the share of busy samples where it is innermost (self)
    and anywhere on the stack (inclusive).
    """
    import collections
    import threading

    # Its own counting, not mlx_trio.profiling's: this process imports the --src checkout, which may predate it.
    from mlx_trio.cli import main as cli_main

    main_id = threading.get_ident()
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    busy = [0, 0]  # busy samples, all samples
    stop = threading.Event()

    def where(frame: Any) -> str:
        code = frame.f_code
        return f"{code.co_filename.split('site-packages/')[-1]}:{code.co_firstlineno}({code.co_name})"

    def sample() -> None:
        while not stop.wait(0.001):
            frame = sys._current_frames().get(main_id)
            busy[1] += 1
            if frame is None or frame.f_code.co_name in ("get_events", "poll"):
                continue
            busy[0] += 1
            leaf[where(frame)] += 1
            seen = set()
            while frame is not None:
                name = where(frame)
                if name not in seen:
                    seen.add(name)
                    inclusive[name] += 1
                frame = frame.f_back

    # The driver turns sampling on for its measured runs only (SIGUSR1), not for start-up and warm-up.
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=sample, daemon=True, name="sampler").start())
    try:
        cli_main(argv)
    finally:
        stop.set()
        n = max(busy[0], 1)
        lines = [f"busy samples {busy[0]} of {busy[1]}", "", "self %  function"]
        lines += [f"{100 * k / n:6.1f}  {name}" for name, k in leaf.most_common(60)]
        lines += ["", "incl %  function"]
        lines += [f"{100 * k / n:6.1f}  {name}" for name, k in inclusive.most_common(120)]
        Path(out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
