"""The KV storage format (`--kv-bits`, `--kv-group-size`, `--quantized-kv-start`) and when a cache converts to it.

mlx-lm's serial rule (`maybe_quantize_kv_cache`, called by `generate_step`
after every forward: each prefill chunk and each decode step): a layer
converts to `QuantizedKVCache` once its offset reaches `start`. A solo row
(engine/batch/solo_row.py) converts at the very token count where
`generate_step`'s chunks of the same step size would (`conversion_point`),
whatever else splits its prefill (snapshots, chunk limits, prompt-cache
hits: `usable_hit`, over entries cut by `entry_cut`), so a lone row is
token-identical to `generate_step(kv_bits=..., kv_group_size=...,
quantized_kv_start=...)`.

A batch holds one format per layer (docs/design.md, "Quantized KV"): it is
quantized as soon as any of its rows has reached `start`, or a quantized row
joins it. The rows below `start` at that moment convert early. Every row is
then token-identical to mlx-lm's serial run whose `quantized_kv_start` is
the row's offset when its batch converted (capped at `start`), up to the
reordered sums of padded attention that any batched row has.

Which layers convert: full-attention ones (mlx-lm's `KVCache` and our
batched `HostPaddedBatchKVCache`). Sliding-window layers stay bf16: mlx-lm
has no quantized rotating cache, serial or batched (both `to_quantized`
raise), so its `generate_step(kv_bits=...)` raises on such a model and
there is no serial run to check one of ours against (docs/design.md §6.4).
Recurrent state (`ArraysCache`) is never quantized. `KvLayout` counts
exactly that (engine/kv/layout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import KVCache

from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
from mlx_trio.engine.kv.quantized_batch_kv import BatchQuantizedKVCache

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts


@attrs.frozen
class KvScheme:
    """How full-attention KV is stored: bf16 (`bits` None, today's behaviour) or quantized from `start` on."""

    bits: int | None = None
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START  # mlx-lm's and mlx_lm.server's default

    def __attrs_post_init__(self) -> None:
        if self.bits is not None and self.bits not in BITS:
            raise ValueError(f"kv_bits must be one of {BITS}, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.start < 0:
            raise ValueError(f"quantized_kv_start must be >= 0, got {self.start}")

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def key(self) -> str:
        """A name for the prompt-cache identity: '' for bf16 (so bf16 keys stay what they were), else e.g. 'q8g64s5000'."""
        return f"q{self.bits}g{self.group_size}s{self.start}" if self.bits is not None else ""

    def stored_key(self, step_size: int) -> str:
        """The KV format as the SSD tier names it: `key()`, and for quantized KV the prefill step size and the
        entry shape too. A quantized entry is cut where its row converted (`conversion_point`), which depends on
        the step size, so a restart with another `--prefill-step-size` must miss the files stored under the old
        one; "e2" names that cut (2026-12-05), so files stored before it are missed as well. bf16: ''."""
        return f"{self.key()}p{step_size}e2" if self.bits is not None else ""

    def conversion_point(self, prompt_len: int, step_size: int) -> int | None:
        """The token count at which mlx-lm's serial `generate_step` converts a row of `prompt_len` tokens
        prefilled in chunks of `step_size`; None without `bits`.

        `generate_step` checks after each forward: its prefill chunks end at `step_size`, `2 step_size`, ...
        and at `prompt_len - 1` (the last prompt token is the first sampling step's input), then every step
        adds one token. A layer converts at the first of those ends that reaches `start`. Which tokens were
        attended in float and which quantized depends on exactly that point, so a row that splits its prefill
        elsewhere (a snapshot boundary, a prompt-cache hit, a smaller chunk) must still convert there, and
        nowhere else, to be token-identical (docs/design.md §6.4).
        """
        if self.bits is None:
            return None
        last = prompt_len - 1  # the prefill's end; then one token a step
        whole = self._whole_chunk(step_size)
        if whole < last:
            return whole
        return last if 0 < last and self.start <= last else max(self.start, prompt_len)

    def _whole_chunk(self, step_size: int) -> int:
        """The first end of a full prefill chunk at or past `start`: where every prompt longer than it converts."""
        return step_size * max(1, -(-self.start // step_size))

    def entry_cut(self, prompt_len: int, step_size: int) -> int | None:
        """How many tokens a quantized prompt-cache entry of this row may keep (None: all of them).

        Entries keep one shape, so that a lookup can tell where one converted from its length alone
        (`usable_hit`): a row converted at the first full chunk keeps everything; any other keeps
        only the tokens it held when it converted, all of them computed over bf16 KV. The tokens
        after those could serve no row exactly: a row of another prompt converts elsewhere.
        """
        at = self.conversion_point(prompt_len, step_size)
        return None if at is None or at == self._whole_chunk(step_size) else at

    def usable_hit(self, usable: int, quantized: bool, held: int, prompt_len: int, step_size: int) -> int:
        """How many of the first `usable` tokens of a prompt-cache entry holding `held` a row of `prompt_len`
        tokens may start from and still attend exactly what mlx-lm's serial run attends (0: none).

        A bf16 entry serves up to the row's conversion point (beyond it mlx-lm's KV is already
        quantized; the hit is trimmed there and the row converts at once). A quantized entry (cut by
        `entry_cut`) converted at `min(held, first full chunk)`: its tokens before that were
        computed over bf16 KV, those after over quantized KV. It serves a row converting at the same
        point, all of what it shares; a row converting earlier, up to that row's point; a row
        converting later, nothing (mlx-lm computes those tokens over bf16 KV, which the entry no
        longer has).
        """
        at = self.conversion_point(prompt_len, step_size)
        if at is None or not quantized:
            return usable if at is None else min(usable, at)
        converted = min(held, self._whole_chunk(step_size))
        if usable < at or at > converted:
            return 0
        return usable if at == converted else at

    def hit_limit(self, prompt_len: int, step_size: int) -> Callable[[bool, int, int], int] | None:
        """`usable_hit` for one prompt, as the prompt cache's lookup takes it (None: no limit, bf16)."""
        if self.bits is None:
            return None
        return lambda quantized, held, usable: self.usable_hit(usable, quantized, held, prompt_len, step_size)

    def convert_due(self, caches: list[Any]) -> None:
        """mlx-lm's `maybe_quantize_kv_cache` on one row's serial caches, in place: layers at offset >= `start`."""
        if self.bits is None:
            return
        for i, cache in enumerate(caches):
            if type(cache) is KVCache and cache.offset >= self.start:
                caches[i] = cache.to_quantized(group_size=self.group_size, bits=self.bits)

    def convert_all(self, caches: list[Any]) -> None:
        """Every convertible layer (serial or batched) to quantized storage, in place, whatever its offset (lazy)."""
        if self.bits is None:
            return
        for i, cache in enumerate(caches):
            if type(cache) is KVCache:
                caches[i] = cache.to_quantized(group_size=self.group_size, bits=self.bits)
            elif type(cache) is HostPaddedBatchKVCache:
                caches[i] = BatchQuantizedKVCache.quantizing(cache, group_size=self.group_size, bits=self.bits)


def is_quantized(caches: Sequence[Any]) -> bool:
    """Whether any layer stores quantized KV (mlx-lm's attention tells them apart by `bits` the same way)."""
    return any(hasattr(c, "bits") for c in caches)
