"""`FrontThread`: the front's Trio loop (hypercorn and `Front.watch`) on a thread of its own.

Why a thread, and not the launcher's loop in one: the launcher (mlx_trio/local_group.py) owns the
main thread's SIGINT and SIGTERM handlers and waits on its rank processes with blocking calls, which
is simple and tested; the front only needs a Trio loop, and Trio runs on any thread (signals are the
main thread's). The two share nothing but a `GroupState`, which is thread-safe.
"""

from __future__ import annotations

import logging
import threading
from typing import cast
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework

from mlx_trio.front.proxy import Front

log = logging.getLogger("mlx_trio.front")


class FrontThread:
    """Serves `front` on `host`:`port` (0: any free port) from `start` until `stop`."""

    def __init__(self, front: Front, host: str, port: int) -> None:
        self._front = front
        self._host = host
        self._port = port
        self.url = ""
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlx-trio-front", daemon=True)

    def start(self) -> str:
        """Bind and serve; the base URL. Raises what binding raised (e.g. the port is taken)."""
        self._thread.start()
        self._bound.wait()
        if self._error is not None:
            raise self._error
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported to `start`, or logged once serving
            self._error = exc
            if self._bound.is_set():
                log.error("the front stopped: %r", exc)
        finally:
            self._bound.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = stop = trio.Event()
        config = HypercornConfig()
        host = f"[{self._host}]" if ":" in self._host else self._host
        config.bind = [f"{host}:{self._port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.graceful_timeout = 1.0
        async with trio.open_nursery() as nursery:
            await nursery.start(self._front.watch)
            binds = await nursery.start(lambda task_status: serve(
                cast(ASGIFramework, self._front), config, mode="asgi", shutdown_trigger=stop.wait,
                task_status=task_status))
            port = next(p for b in binds if (p := urlsplit(b).port) is not None)
            self.url = f"http://{host}:{port}"
            self._bound.set()
            await stop.wait()
            nursery.cancel_scope.cancel()  # the ranks are gone by now: nothing in flight can finish
