"""mlx-trio: an LLM serving engine on MLX, built as supervised Trio actors.

    async with mlx_trio.open_engine() as engine:
        print((await engine.complete("What is the capital of France?")).text)

Names are imported lazily so that `import mlx_trio.errors` (say, in the HTTP
layer) does not load MLX.
"""

from __future__ import annotations

from mlx_trio.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "mlx_trio.api",
    "open_engine": "mlx_trio.api",
    "EngineConfig": "mlx_trio.config",
    "SamplingParams": "mlx_trio.params",
    "Completion": "mlx_trio.events",
    "Finished": "mlx_trio.events",
    "PromptProgress": "mlx_trio.events",
    "TextDelta": "mlx_trio.events",
    "Usage": "mlx_trio.events",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
