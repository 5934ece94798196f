"""The servers under test: ones the bench starts itself, and ones given by URL.

`--serve ours` runs `python -m mlx_trio.cli serve` and `--serve mlx_lm` runs
`python -m mlx_lm.server`, each on a free loopback port with the same model
directory, output to a log file. They are stopped by pid: SIGTERM, a bounded
wait, then SIGKILL. A server that died during a run is started again, on a new
port, before its next run.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import httpx
import trio

log = logging.getLogger("mlx_trio.bench")

# GET this until it answers 200. Ours is 200 only once the model is loaded; mlx_lm.server's
# /health says ok before it has loaded, so the warmup request is what waits for its model.
# (Not mlx_lm.server's /v1/models: it raises mid-response on a machine with no Hugging Face cache.)
READY_PATHS = {"ours": "/health", "ours-nocache": "/health", "ours-cudnn": "/health",
               "ours-mlx-attention": "/health", "mlx_lm": "/health"}
# What a stack adds to the server's environment: ours-cudnn is ours with prefill-only cuDNN attention
# named (engine/lease_thread.py; CUDA's default), its plans built at start (actors/plan_warmup.py);
# ours-mlx-attention is ours with MLX's own attention kernels.
STACK_ENV: dict[str, dict[str, str]] = {"ours-cudnn": {"MLX_TRIO_ATTENTION_BACKEND": "cudnn-prefill"},
                                        "ours-mlx-attention": {"MLX_TRIO_ATTENTION_BACKEND": "mlx"}}
POLL_S = 0.25
STOP_GRACE_S = 15.0  # ours drains for 3 s on SIGTERM; leave room for a slow exit
LOG_TAIL_CHARS = 2000


class ServerStartError(RuntimeError):
    """A managed server exited or did not become ready in time; the message holds its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_argv(stack: str, model: str, port: int, *, python: str = sys.executable,
                extra_args: Sequence[str] = ()) -> list[str]:
    """The command line that serves `model` with `stack` on 127.0.0.1:`port`."""
    module = {"ours": ["mlx_trio.cli", "serve"], "mlx_lm": ["mlx_lm.server"],
              "ours-nocache": ["mlx_trio.cli", "serve", "--prompt-cache-bytes", "0"],
              "ours-cudnn": ["mlx_trio.cli", "serve"], "ours-mlx-attention": ["mlx_trio.cli", "serve"]}[stack]
    return [python, "-m", *module, "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "WARNING", *extra_args]


def default_model_path(python: str = sys.executable, timeout_s: float = 1800.0) -> str:
    """Our default model (SmolLM2, converted once) as a directory, asked of a subprocess.

    A subprocess, because the converter imports mlx and this package must not.
    """
    code = "from mlx_trio.engine.model.default_model import ensure_default_model; print(ensure_default_model())"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise ServerStartError(f"could not prepare the default model: {done.stderr.strip()[-LOG_TAIL_CHARS:]}")
    return done.stdout.strip().splitlines()[-1]


@attrs.define
class UrlServer:
    """A server someone else runs; the bench neither starts nor stops it."""

    name: str
    base_url: str

    @property
    def url(self) -> str:
        return normalize_url(self.base_url)

    async def ensure_up(self) -> None:
        return None

    def exited(self) -> bool:
        return False

    def stop(self) -> None:
        return None


@attrs.define
class ManagedServer:
    """A server process the bench started; `start`/`ensure_up` are Trio-side, `stop` is sync and bounded."""

    name: str
    stack: str
    model: str
    log_path: Path
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0
    port: int = 0
    restarts: int = 0
    # Seconds from the first launch to its ready path answering 200 (None before it started): the start-up
    # time issue #46 compares with mlx_lm.server's.
    startup_s: float | None = None
    # Another checkout's package: run from its directory (cwd comes first on `python -m`'s path).
    cwd: str | None = None
    env: Mapping[str, str] = attrs.field(factory=dict)  # added to this process's environment
    _proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def exited(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    async def start(self) -> None:
        """Start the process and wait until it answers its ready path; raises `ServerStartError`."""
        self.port = free_port()
        argv = server_argv(self.stack, self.model, self.port, python=self.python, extra_args=self.extra_args)
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop)
        # A new session: a Ctrl-C at the terminal reaches the bench only, which then stops this pid itself.
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=self.cwd,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        self._log.write(f"\n$ {shlex.join(argv)}  # pid {self._proc.pid}\n".encode())
        self._log.flush()
        log.info("%s: started pid %d on port %d (log %s)", self.name, self._proc.pid, self.port, self.log_path)
        launched = time.monotonic()
        try:
            await self._wait_ready()
        except BaseException:
            self.stop()
            raise
        if self.startup_s is None:
            self.startup_s = time.monotonic() - launched

    async def ensure_up(self) -> None:
        """Restart the process if it has exited (it died in an earlier run)."""
        if self.exited():
            log.warning("%s: the process had exited (status %s); restarting it", self.name,
                        self._proc.returncode if self._proc else None)
            self.stop()
            self.restarts += 1
            await self.start()

    async def _wait_ready(self) -> None:
        deadline_s = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if self.exited():
                    raise ServerStartError(f"{self.name} exited during startup:\n{self.log_tail()}")
                try:
                    response = await client.get(self.url + READY_PATHS[self.stack])
                    if response.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline_s:
                    raise ServerStartError(f"{self.name} not ready after {self.startup_timeout_s:.0f} s:\n"
                                           f"{self.log_tail()}")
                await trio.sleep(POLL_S)

    def stop(self) -> None:
        """SIGTERM the pid, wait up to STOP_GRACE_S, then SIGKILL it; close the log. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                # Our server drains in-flight streams on SIGTERM (--shutdown-timeout): with clients still
                # connected (a cut run) that can outlast the grace period.
                log.warning("%s: pid %d still running %.0f s after SIGTERM; killing it", self.name, proc.pid,
                            STOP_GRACE_S)
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"


def normalize_url(url: str) -> str:
    """`http://host:port[/v1][/]` → `http://host:port` (the client appends /v1/...)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# How long a benchmark waits for our server's idle-time cuDNN plans (`plans_settled`).
PLANS_LIMIT_S = 240.0


async def plans_settled(url: str, limit_s: float = PLANS_LIMIT_S) -> str | None:
    """Wait while our server still plans cuDNN shapes in idle time (`cudnn_plans_pending` in /v1/status);
    return the attention backend it runs (`attention_backend`, for the benchmark's log).

    Each idle-time plan is a lease job on the shared GPU: planned during another load's runs (the
    engine's, mlx_lm.server's), it would slow that one and flatter our ratios.
    """
    start = time.perf_counter()
    counters: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=10.0) as client:
        while time.perf_counter() - start < limit_s:
            counters = (await client.get(f"{url}/v1/status")).json().get("counters", {})
            if not counters.get("cudnn_plans_pending"):
                break
            await trio.sleep(1.0)
        else:
            print(f"# cuDNN plans still pending after {limit_s:.0f} s; measuring anyway", flush=True)
    return counters.get("attention_backend")
