"""How many bytes a request's KV cache can grow to: the admission budget's arithmetic.

GPU out-of-memory cannot be caught, so admission projects the worst case
before a request runs (docs/design.md §1.3, §6.1): a row's cache at
`prompt + max_tokens` tokens for this model's cache layout, plus the
transient of prefilling one chunk. The layout is measured once, at load,
by running one token through a fresh cache; that way every architecture
mlx-lm supports is covered by the same code (full attention, sliding
windows capped at the window, fixed-size recurrent state).

With quantized KV (`--kv-bits`, engine/kv/kv_scheme.py) the full-attention
layers of a row past the start hold packed values plus a scale and a bias
per group: measured the same way, by quantizing that one-token cache.
"""

from __future__ import annotations

import os

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from mlx_trio.engine.kv import quantized_attention_probe
from mlx_trio.engine.kv.kv_scheme import BITS, GROUP_SIZES, KvScheme

# Headroom kept free for activations, the allocator's cache and the OS.
_HEADROOM_FRACTION = 0.2
_MIN_HEADROOM_BYTES = 1 << 30


@attrs.frozen
class KvLayout:
    """Per-token and fixed KV bytes of one row, by layer kind."""

    full_bytes_per_token: int  # all full-attention layers together
    window_bytes_per_token: int  # all sliding-window layers together
    window: int  # tokens a sliding-window layer keeps (0 when there are none)
    fixed_bytes: int  # recurrent state (ArraysCache) and anything that does not grow
    num_heads: int
    hidden_size: int
    activation_bytes: int  # bytes per activation element (dtype size)
    batchable: bool  # every layer cache can merge into a batch (mlx_lm.server's test)
    # Quantized KV: all full-attention layers' bytes per token once quantized, and from how many tokens
    # a row is (None: bf16 only).
    quantized_bytes_per_token: int = 0
    quantized_start: int | None = None

    def row_bytes(self, num_tokens: int) -> int:
        """Worst-case KV bytes of one row growing to `num_tokens` tokens.

        Quantized KV: the larger of the row just before its start (bf16) and
        at `num_tokens` (quantized). A row its batch converted early holds
        less, never more.
        """
        windowed = min(num_tokens, self.window) if self.window else 0
        return self._full_bytes(num_tokens) + self.window_bytes_per_token * windowed + self.fixed_bytes

    def _full_bytes(self, num_tokens: int) -> int:
        start = self.quantized_start
        if start is None or num_tokens < start:
            return self.full_bytes_per_token * num_tokens
        return max(self.full_bytes_per_token * max(start - 1, 0), self.quantized_bytes_per_token * num_tokens)

    def prefill_transient_bytes(self, prefix_tokens: int, chunk_tokens: int) -> int:
        """Peak extra bytes while one chunk is prefilled against a prefix.

        Attention scores of the chunk against the whole prefix (float32, all
        heads: the unfused CPU path materialises them) plus the chunk's
        activations (a generous 8 hidden-sized tensors per token).
        """
        scores = self.num_heads * chunk_tokens * (prefix_tokens + chunk_tokens) * 4
        activations = 8 * chunk_tokens * self.hidden_size * self.activation_bytes
        return scores + activations

    def prefill_peak_bytes(self, prompt_tokens: int, prefill_step_size: int) -> int:
        """The transient of a prompt's worst prefill chunk (a full chunk against the whole prompt)."""
        chunk = min(prefill_step_size, max(prompt_tokens - 1, 1))
        return self.prefill_transient_bytes(prompt_tokens, chunk)

    def request_bytes(self, prompt_tokens: int, max_tokens: int, prefill_step_size: int) -> int:
        """What a request needs running alone: its final cache plus its worst prefill chunk."""
        return self.row_bytes(prompt_tokens + max_tokens) + self.prefill_peak_bytes(prompt_tokens, prefill_step_size)


def measure_layout(model: nn.Module, kv_scheme: KvScheme = KvScheme()) -> KvLayout:
    """Run one token through a fresh cache and read off each layer's bytes. Lease thread only.

    Raises ValueError when `kv_scheme` cannot quantize this model's KV (a head dimension its group size does
    not divide): at load, not in the middle of a request. Whether the backend can attend over it is
    `check_quantized_attention`'s question.
    """
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    full = window_bytes = fixed = quantized = 0
    window = 0
    for layer in cache:
        if type(layer) is KVCache and kv_scheme.bits is not None:
            quantized += _bytes_per_token(layer.to_quantized(group_size=kv_scheme.group_size, bits=kv_scheme.bits))
        if isinstance(layer, RotatingKVCache):
            window_bytes += _bytes_per_token(layer)
            window = max(window, layer.max_size)
        elif isinstance(layer, KVCache):
            full += _bytes_per_token(layer)
        else:
            fixed += layer.nbytes
    args = getattr(model, "args", None)
    num_heads = int(getattr(args, "num_attention_heads", 1) or 1)
    hidden = int(getattr(args, "hidden_size", 0) or 0)
    dtype_bytes = _activation_bytes(model)
    return KvLayout(
        full_bytes_per_token=full, window_bytes_per_token=window_bytes, window=window,
        fixed_bytes=fixed, num_heads=num_heads, hidden_size=hidden, activation_bytes=dtype_bytes,
        batchable=all(hasattr(c, "merge") for c in cache),
        quantized_bytes_per_token=quantized,
        quantized_start=kv_scheme.start if kv_scheme.bits is not None else None,
    )


def check_quantized_attention(model: nn.Module, kv_scheme: KvScheme) -> None:
    """Attention over quantized KV runs, and right, on this backend; raises ValueError saying why not.

    Nothing to check (and nothing run) for bf16 KV. Lease thread, at load.

    Two checks: the model's own prefill and decode step over a quantized cache, evaluated; and mlx-lm's
    quantized SDPA at the model's head shapes against SDPA over the same dequantized values, for both
    buffer layouts a cache hands attention (engine/kv/quantized_attention_probe.py). MLX's CUDA backend
    (0.32.x) fails the first for every bits and group size, and would compute the second wrongly for a
    grouped-query model (docs/design.md §6.4): a server would fail its first request, or answer wrongly,
    instead of refusing the flag. The message names the `--kv-bits`/`--kv-group-size` pairs that pass here.
    """
    if kv_scheme.bits is None:
        return
    why = _quantized_attention_failure(model, kv_scheme.bits, kv_scheme.group_size)
    if why is None:
        return
    shape = quantized_attention_probe.attention_shape(model)
    others = [(bits, group) for bits in BITS for group in GROUP_SIZES
              if shape is not None and shape[2] % group == 0 and (bits, group) != (kv_scheme.bits, kv_scheme.group_size)]
    passing = [f"--kv-bits {bits} --kv-group-size {group}" for bits, group in others
               if _quantized_attention_failure(model, bits, group) is None]
    instead = f"these pass here: {', '.join(passing)}" if passing else "no --kv-bits/--kv-group-size pair passes here"
    raise ValueError(f"--kv-bits {kv_scheme.bits} --kv-group-size {kv_scheme.group_size}: attention over "
                     f"quantized KV cannot run right on {mx.default_device()} with this MLX ({why}); {instead}; "
                     "serve without --kv-bits (docs/design.md §6.4)")


def _quantized_attention_failure(model: nn.Module, bits: int, group_size: int) -> str | None:
    cache = make_prompt_cache(model)
    try:
        model(mx.array([[1, 2, 3]]), cache=cache)
        cache = [c.to_quantized(group_size=group_size, bits=bits) if type(c) is KVCache else c for c in cache]
        model(mx.array([[4, 5]]), cache=cache)
        mx.eval(model(mx.array([[6]]), cache=cache))
    except (RuntimeError, ValueError) as exc:
        return str(exc).split("\n")[0]
    shape = quantized_attention_probe.attention_shape(model)
    if shape is None:
        return None
    return quantized_attention_probe.serving_failure(shape, bits=bits, group_size=group_size)


def _bytes_per_token(layer: KVCache | RotatingKVCache | QuantizedKVCache) -> int:
    # Buffers are preallocated in steps; the per-token cost is bytes / capacity.
    parts = [*layer.keys, *layer.values] if isinstance(layer, QuantizedKVCache) else [layer.keys, layer.values]
    return sum(p.nbytes for p in parts) // parts[0].shape[2]


def _activation_bytes(model: nn.Module) -> int:
    # The embedding's dtype is the activations' dtype (quantized models keep float scales).
    for name, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype.size
    return 4


def weights_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def device_memory_bytes() -> int:
    """Memory the device can use: the GPU's own size where MLX reports one, else physical RAM."""
    info = mx.device_info()
    for key in ("memory_size", "total_memory", "max_recommended_working_set_size"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return int(info[key])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_headroom_bytes() -> int:
    """Device memory left out of the KV budget, for activations and whatever else runs: a share of the device."""
    return max(int(device_memory_bytes() * _HEADROOM_FRACTION), _MIN_HEADROOM_BYTES)


def device_memory_reading() -> tuple[int, int] | None:
    """(the device's free bytes, the bytes this process's MLX holds: active + its cache of freed buffers), where
    the backend reports free memory (CUDA); None elsewhere (Metal and the CPU report none). Their sum is what other
    processes leave us. Lease thread (actors/memory_budget.py re-reads it about once a second)."""
    free = mx.device_info().get("free_memory")
    if not isinstance(free, int) or free <= 0:
        return None
    return free, mx.get_active_memory() + mx.get_cache_memory()


def default_kv_budget(weights: int) -> int:
    """The default `--kv-budget`: what the device has free, less headroom. Call after the weights load.

    Where MLX reports the device's free memory (CUDA), that is the base: it
    already excludes our weights and whatever other processes hold (on the
    H200, a second server beside ours made a whole-GPU budget run out of
    memory at 64 rows). Elsewhere (unified memory): total minus the weights.
    """
    info = mx.device_info()
    total = device_memory_bytes()
    headroom = memory_headroom_bytes()
    free = info.get("free_memory")
    if isinstance(free, int) and free > 0:
        return max(free - headroom, 0)
    return max(total - weights - headroom, 0)
