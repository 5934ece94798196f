"""The engine's Trio actors: the GPU lease, admission, prefill, decode-step, prompt caching, sessions.

Never imports mlx: every MLX call is a job on the GPU lease (docs/gpu-lease.md).
"""
