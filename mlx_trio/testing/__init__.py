"""Helpers for mlx-trio's own tests (and for anyone testing code built on it)."""

from mlx_trio.testing.tiny_models import (
    LLAMA,
    LLAMA_SWA,
    QWEN3,
    QWEN3_TOOLS,
    TinyModelSpec,
    build_tiny_model,
    tiny_model,
)

__all__ = ["LLAMA", "LLAMA_SWA", "QWEN3", "QWEN3_TOOLS", "TinyModelSpec", "build_tiny_model", "tiny_model"]
