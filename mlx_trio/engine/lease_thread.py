"""MLX set-up and tear-down for the thread that owns every MLX call.

The GPU lease (`mlx_trio.actors.gpu_lease.GpuLease`) is MLX-agnostic; it runs
these functions in its thread through its ``on_thread_start`` /
``on_thread_exit`` hooks. Since mlx 0.31.2 each OS thread has its own default
stream and thread-local command encoders, so the thread that builds a lazy
graph must be the thread that evaluates it, and a thread that used MLX must
drop its streams before it ends (docs/gpu-lease.md; docs/design.md §8.1
and §8.2).

No Trio here: these are plain sync functions that block until MLX is done.
"""

from __future__ import annotations

import os

import mlx.core as mx

# MLX's CUDA backend runs attention through cuDNN when it can, and builds (then caches, per
# thread, 256 at most) one cuDNN graph per exact shape: every new (query length, key length)
# of a prefill chunk and every 256-token growth of a lone row's KV buffer. A build costs
# ~50 ms (H200, 1B shape; the first one ~0.5 s), and a server meets new shapes all the time:
# prompt lengths and cache-hit offsets differ per request. Measured on an H200 (1B shape, an
# 8.5k-token prompt in 512-token chunks while 4 rows decode, docs/benchmarks.md): chunks took
# 56 ms with cuDNN on unseen shapes (7.6 ms on seen ones) against 22-30 ms with MLX's own
# kernels, and the first long request stalled the running rows for seconds. So MLX's own
# kernels are the default here; setting the variable yourself (to 1) wins.
CUDNN_ATTENTION_ENV = "MLX_CUDA_USE_CUDNN_SDPA"
# When cuDNN attention is chosen all the same, its plan cache holds 256 shapes by default; the prefill
# shape grid's shapes (chunk lengths × key lengths up to a long context, engine/batch/chunked_prefill.py)
# can exceed that, and an evicted plan costs ~45 ms again. A user's own setting wins.
CUDNN_PLAN_CACHE_ENV, CUDNN_PLAN_CACHE_SIZE = "MLX_CUDA_SDPA_CACHE_SIZE", "2048"


def prepare_thread() -> mx.Stream:
    """The lease's ``on_thread_start``: MLX's own attention kernels (see above), and the thread's stream.

    Both variables are read when MLX first runs attention (on this thread: the cache is per thread),
    so setting them here, before any job, takes effect.
    """
    os.environ.setdefault(CUDNN_ATTENTION_ENV, "0")
    os.environ.setdefault(CUDNN_PLAN_CACHE_ENV, CUDNN_PLAN_CACHE_SIZE)
    return thread_default_stream()


def thread_default_stream() -> mx.Stream:
    """Return the calling thread's default stream, creating it if needed.

    Used as the lease's ``on_thread_start`` hook this creates the stream (and,
    on the CPU backend, its scheduler OS thread) when the lease opens, so the
    first job does not pay for it.
    """
    return mx.default_stream(mx.default_device())


def release_thread_streams() -> None:
    """Wait for all queued MLX work of this thread, then destroy its streams.

    Must run in a thread that used MLX before that thread exits: without it the
    process intermittently aborts at interpreter exit with ``terminate called
    without an active exception`` (measured 4 of 6 runs; 0 of 16 with this
    cleanup; mlx PR #4110 recommends exactly this). Arrays that were already
    evaluated stay valid and usable from other threads; lazy arrays recorded on
    this thread's streams cannot be evaluated afterwards.

    Call it once, last: afterwards this thread cannot run MLX at all (measured
    with mlx 0.32.4: the next op raises ``There is no Stream(cpu, N) in current
    thread``: its default stream was destroyed and is not recreated).

    Raises whatever `mx.synchronize` raises for a pending stream error; the
    streams are cleared in any case.
    """
    try:
        mx.synchronize()
    finally:
        mx.clear_streams()
