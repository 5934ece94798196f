"""What the handlers share: the engine (as the small surface they use), the config, counters."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol

import attrs

from mlx_trio.errors import MlxTrioError
from mlx_trio.events import GenerationEvent
from mlx_trio.http.config import ServerConfig


class EngineLike(Protocol):
    """What the HTTP layer needs from `mlx_trio.api.Engine`."""

    def health(self) -> tuple[bool, str]: ...

    def status(self) -> dict[str, Any]: ...

    @property
    def model_id(self) -> str: ...  # raises an MlxTrioError while the model loads

    def prepare(self, prompt: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                **sampling: Any) -> Any: ...

    def stream(self, request: Any) -> AsyncIterator[GenerationEvent]: ...


@asynccontextmanager
async def closing(events: AsyncIterator[GenerationEvent]) -> AsyncIterator[AsyncIterator[GenerationEvent]]:
    """Close an `Engine.stream` on exit, however the block is left.

    `Engine.stream` is an async generator: closing it is how a request is
    cancelled in the engine (its KV cache freed), so a client that goes away
    must never leave it to the garbage collector.
    """
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


@attrs.define
class AppState:
    """What the handlers share: the engine, the config, and the HTTP layer's own counters."""

    engine: EngineLike
    config: ServerConfig
    started_at: int = attrs.field(factory=lambda: int(time.time()))
    # Requests handed to the engine since start (the /stats `submitted_rows`).
    submitted_rows: int = 0
    # Set when a graceful shutdown begins: /health turns 503, new completions are refused.
    draining: bool = False

    def model_name(self) -> str:
        """The served model id; never empty, even while the model loads."""
        if self.config.model_name:
            return self.config.model_name
        try:
            return self.engine.model_id
        except MlxTrioError:
            return "default"
