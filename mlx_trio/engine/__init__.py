"""The engine's synchronous MLX mechanics, by room: model, kv, batch, sampling, prompt_cache.

Never imports trio: its MLX calls run as jobs on the GPU lease thread (docs/gpu-lease.md).
"""
