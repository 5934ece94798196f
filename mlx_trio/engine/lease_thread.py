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

import logging
import os
from collections.abc import Mapping, MutableMapping

import mlx.core as mx

from mlx_trio.engine.kv import decode_layout

log = logging.getLogger("mlx_trio.engine")

# MLX's CUDA backend runs attention through cuDNN when it can, and builds (then caches, per
# thread, 256 at most) one cuDNN graph per exact shape: every new (query length, key length)
# of a prefill chunk and every 256-token growth of a lone row's KV buffer. A build costs
# ~50 ms (H200, 1B shape; the first one ~0.5 s), and a server meets new shapes all the time:
# prompt lengths and cache-hit offsets differ per request. Measured on an H200 (1B shape, an
# 8.5k-token prompt in 512-token chunks while 4 rows decode, docs/lab-notes/): chunks took
# 56 ms with cuDNN on unseen shapes (7.6 ms on seen ones) against 22-30 ms with MLX's own
# kernels, and the first long request stalled the running rows for seconds. So MLX's own
# kernels are the default here; setting the variable yourself wins (0: MLX's kernels, else cuDNN
# wherever MLX takes it, decode included).
CUDNN_ATTENTION_ENV = "MLX_CUDA_USE_CUDNN_SDPA"
# When cuDNN attention is chosen all the same, its plan cache holds 256 shapes by default; the prefill
# shape grid's shapes (chunk lengths × key lengths up to a long context, engine/batch/chunked_prefill.py)
# can exceed that, and an evicted plan costs ~45 ms again. A user's own setting wins.
CUDNN_PLAN_CACHE_ENV, CUDNN_PLAN_CACHE_SIZE = "MLX_CUDA_SDPA_CACHE_SIZE", "2048"

# Which attention kernels the process runs (vLLM's VLLM_ATTENTION_BACKEND's twin), when
# MLX_CUDA_USE_CUDNN_SDPA is not set: "mlx" (MLX's own kernels everywhere), "cudnn" (MLX's
# default: cuDNN wherever it takes it), or "cudnn-prefill": cuDNN for multi-token queries
# (prefill chunks, whose shapes the grid repeats, so their plans are built once: a warm 512-token
# chunk at ~6k context 5.6-7.8 ms against 16-27 ms) and MLX's vector kernel for decode steps
# (faster there than cuDNN: B=1 289 vs 252 tok/s), one process. MLX reads its variable once per
# process, so the split rests on a per-call condition of MLX's dispatch: decode's keys laid out so
# that cuDNN's decode path refuses them (engine/kv/decode_layout.py; docs/design.md §4.6).
ATTENTION_BACKEND_ENV = "MLX_TRIO_ATTENTION_BACKEND"
MLX_KERNELS, CUDNN, CUDNN_PREFILL = "mlx", "cudnn", "cudnn-prefill"
ATTENTION_BACKENDS = (MLX_KERNELS, CUDNN, CUDNN_PREFILL)
# The choice on CUDA when neither variable is set: prefill-only cuDNN, its plans built ahead by the
# prefill actor (actors/plan_warmup.py, --cudnn-warm-tokens). H200, Llama-1B shape (
# docs/lab-notes/2026-12-01-h200-pass11.md): an 8.5k prompt beside 4 streams reached its first
# token in 121-166 ms with the largest decode gap 23-29 ms (MLX's kernels: 305-431 ms), and the
# agent loop's TTFT p50 was 176 ms against MLX's kernels' 781 and mlx_lm.server's 847 (8B shape:
# 482 / 1729 / 2897). Speculation still falls back to MLX's kernels (`attention_backend`);
# MLX_TRIO_ATTENTION_BACKEND=mlx restores them.
DEFAULT_CUDA_BACKEND = CUDNN_PREFILL
# Lists the variables above that a lease thread set for its own process, not the user (`forget_inherited`).
SET_BY_LEASE_ENV = "MLX_TRIO_SET_BY_LEASE"

# The first lease thread's choice: MLX reads its variable once per process, so later threads
# (a restarted lease) must keep it, whatever the environment says by then.
_chosen: str | None = None


def attention_backend(env: Mapping[str, str], *, cuda: bool, speculates: bool = False) -> str:
    """The attention backend for a process with environment `env` (one of `ATTENTION_BACKENDS`).

    `cuda`: MLX runs on its CUDA backend (elsewhere every choice is MLX's own kernels: the
    variables mean nothing there). `speculates`: the engine verifies draft tokens, a query of
    a few tokens at a new key length every step, which cuDNN would plan afresh each time
    (~45 ms), so "cudnn-prefill" falls back to MLX's kernels.

    Raises:
      ValueError: `MLX_TRIO_ATTENTION_BACKEND` names no backend.
    """
    named = env.get(ATTENTION_BACKEND_ENV, "").strip().lower()
    if named and named not in ATTENTION_BACKENDS:
        raise ValueError(f"{ATTENTION_BACKEND_ENV}={named!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if not cuda:
        return MLX_KERNELS
    mlx_setting = env.get(CUDNN_ATTENTION_ENV)
    if mlx_setting is not None and mlx_setting.strip():
        return MLX_KERNELS if mlx_setting.strip() == "0" else CUDNN
    chosen = named or DEFAULT_CUDA_BACKEND
    return MLX_KERNELS if chosen == CUDNN_PREFILL and speculates else chosen


def prepare_thread(*, speculates: bool = False) -> mx.Stream:
    """The lease's ``on_thread_start``: the attention backend (see above), and the thread's stream.

    MLX reads both variables when it first runs attention (on this thread: the cache is per
    thread), so setting them here, before any job, takes effect. The backend is chosen once
    per process (`_chosen`); "cudnn-prefill" also turns on decode's layout
    (`decode_layout.set_active`).
    """
    global _chosen
    if _chosen is None:
        forget_inherited(os.environ)
        cuda = on_cuda()
        _chosen = attention_backend(os.environ, cuda=cuda, speculates=speculates)
        if cuda:
            log.info("attention on CUDA: %s (%s)", _chosen, _why(os.environ, speculates))
    set_here = _names(os.environ.get(SET_BY_LEASE_ENV))
    for name, value in ((CUDNN_ATTENTION_ENV, "0" if _chosen == MLX_KERNELS else "1"),
                        (CUDNN_PLAN_CACHE_ENV, CUDNN_PLAN_CACHE_SIZE)):
        if name not in os.environ:
            os.environ[name] = value
            set_here.append(name)
    if set_here:
        os.environ[SET_BY_LEASE_ENV] = ",".join(set_here)
    decode_layout.set_active(_chosen == CUDNN_PREFILL)
    return thread_default_stream()


def _why(env: Mapping[str, str], speculates: bool) -> str:
    """Which setting made `attention_backend`'s choice, for the log."""
    mlx_setting = (env.get(CUDNN_ATTENTION_ENV) or "").strip()
    if mlx_setting:
        return f"{CUDNN_ATTENTION_ENV}={mlx_setting}, set by the user"
    named = (env.get(ATTENTION_BACKEND_ENV) or "").strip()
    source = f"{ATTENTION_BACKEND_ENV}={named}" if named else "the default"
    return f"{source}, speculating" if speculates else source


def forget_inherited(env: MutableMapping[str, str]) -> None:
    """Drop from `env` the variables a parent's lease thread set for its own process (`SET_BY_LEASE_ENV`).

    `prepare_thread` sets MLX's variables in the process environment (MLX reads
    them there), and every process started afterwards inherits them: a benchmark
    that opened an engine, then started `mlx-trio serve`, gave the server
    `MLX_CUDA_USE_CUDNN_SDPA=1`, which reads as the user's choice of cuDNN
    everywhere, so the server ran cuDNN decode and built a cuDNN plan for every
    new cohort shape (~0.6 s each on an H200,
    docs/lab-notes/2026-12-04-h200-pass20.md) instead of its default. A child
    chooses as if started from the user's shell; what the user set (never
    listed) stays.
    """
    for name in _names(env.pop(SET_BY_LEASE_ENV, None)):
        env.pop(name, None)


def _names(listed: str | None) -> list[str]:
    return [name for name in (listed or "").split(",") if name]


def chosen_backend() -> str | None:
    """The backend the first lease thread chose (None before one started)."""
    return _chosen


def on_cuda() -> bool:
    """Whether MLX runs on its CUDA backend (the GPU device of a CUDA build)."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


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
