"""A front process: the HTTP app on hypercorn, serving the engine of its parent over the engine link.

    python -m mlx_trio.processes.front_process --link SOCKET --config FILE --listen-fd FD --index I [--ready-fd R]

Started only by `FrontPool` (front_pool.py), which passes the public
listening socket as `FD` (every front accepts from the one socket the parent
bound, so the port stays bound while a front restarts), the engine link's
socket and the `ServerConfig` (its fields pickled in the pool's private directory).

Its tree: `front-I` (one_for_one) over `engine-link` (`RemoteEngine.run`) and
`http` (`HttpServer.run`, which a `kill-listener` fault restarts as in one
process). SIGTERM drains: no new completions, running ones finish (up to
`shutdown_timeout_s`), then the process exits 0; a second SIGTERM exits at
once. The process also exits when its parent is gone (it has no engine left
to serve).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import pickle
import signal
import sys
from collections.abc import Sequence

import trio

from mlx_trio.errors import EngineFailure
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.http.server.http_server import HttpServer
from mlx_trio.processes.orphan import until_orphaned
from mlx_trio.link.remote_engine import RemoteEngine
from mlx_trio.supervision import Strategy, Supervisor

log = logging.getLogger("mlx_trio.link")

READY_POLL_S = 0.05


async def serve_front(config: ServerConfig, link_path: str, index: int, ready_fd: int | None = None) -> None:
    """Serve until SIGTERM (drain, then return) or until the parent process is gone; write to `ready_fd` (then
    close it) once this front's `/health` first reads ok."""
    parent = os.getppid()
    engine = RemoteEngine(link_path)
    server = HttpServer(config, engine)
    tree = Supervisor(f"front-{index}", [engine.child_spec, server.child_spec], strategy=Strategy.ONE_FOR_ONE,
                      max_restarts=1_000_000, period_s=1.0)
    engine.local_status = tree.status
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(tree.run)
            nursery.start_soon(_freeze_when_known, engine)
            if ready_fd is not None:
                nursery.start_soon(_say_ready, engine, ready_fd)

            async def orphaned() -> None:
                await until_orphaned(parent)
                log.error("front %d: the engine process is gone; exiting", index)
                nursery.cancel_scope.cancel()

            nursery.start_soon(orphaned)
            async for _ in signals:
                async with trio.open_nursery() as draining:
                    async def second_signal() -> None:
                        async for _ in signals:
                            draining.cancel_scope.cancel()

                    draining.start_soon(second_signal)
                    report = await server.drain()
                    log.info("front %d drained in %.1f s: %d request(s) were in flight, %d cut", index,
                             report.elapsed_s, report.in_flight_at_start, report.cut)
                    draining.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
                break


async def _say_ready(engine: RemoteEngine, ready_fd: int) -> None:
    """Tell the pool that this front's engine link reads healthy: the launcher prints "serving" only once every
    front has (a front whose first connection came before the engine's socket existed retries a moment later,
    and a client meanwhile read "not reachable" from a server that said it was serving)."""
    while not engine.health()[0]:
        await trio.sleep(READY_POLL_S)
    os.write(ready_fd, b"ready")
    os.close(ready_fd)


async def _freeze_when_known(engine: RemoteEngine) -> None:
    """`gc.freeze()` once the engine first named its model, as `mlx-trio serve` freezes once it is ready.

    The collector then no longer scans what lives as long as the front. Not
    at the first connection: the facts that name the model import mlx-lm when
    they are unpickled (its tool parser), and on an H200 host that left ~385k
    objects to every full collection, each a pause of ~180 ms for every stream
    of the front (docs/lab-notes/2026-12-04-h200-pass20.md).
    """
    await engine.model_known.wait()
    # On a worker thread: its imports take seconds on a small CPU (1-1.5 s, 2-core CPU, SmolLM2's tool
    # parser) and on the event loop they held every /health and request back just as the model got ready.
    await trio.to_thread.run_sync(_read_output_format, engine)
    gc.freeze()


def _read_output_format(engine: RemoteEngine) -> None:
    """Unpickle the engine's output format once, so that what it imports is frozen with the rest."""
    try:
        engine.output_format  # noqa: B018
    except EngineFailure:  # the link broke meanwhile: freeze what there is
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx_trio.processes.front_process")
    parser.add_argument("--link", required=True, help="the engine link's Unix socket")
    parser.add_argument("--config", required=True, help="the pickled ServerConfig")
    parser.add_argument("--listen-fd", type=int, required=True, help="the public listening socket (inherited)")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--ready-fd", type=int, default=None, help="a pipe to write to once /health reads ok")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s %(name)s[front {args.index}]: "
                                                     "%(message)s")
    with open(args.config, "rb") as f:
        fields = pickle.load(f)
    config = ServerConfig(**{**fields, "listen_fd": args.listen_fd})
    # Ctrl-C in a terminal reaches the whole process group: the parent drains the fronts (SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        trio.run(serve_front, config, args.link, args.index, args.ready_fd)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
