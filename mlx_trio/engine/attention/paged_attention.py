"""Attention over a paged cache's block tables: one interface, the kernel chosen by the backend.

`attend(queries, cache, scale)` is what the routed attention calls for a
`PagedLayerCache` (engine/kv/blocks/paged_kv.py), for decode steps and prefill
chunks alike. Today every backend runs the MLX-ops reference
(paged_reference.py), which is exact and runs anywhere, the CPU included.

KERNELS: where a backend's kernel goes. A `mx.fast.cuda_kernel` (CUDA) or
`mx.fast.metal_kernel` (Metal) variant that reads each row's blocks in place
(no gather) is to be added here as `_kernel_for(backend)`, selected only on
that backend, after a load-time self-check against the reference (as
ragged_kernel.self_check does), and only where it measures faster; its
correctness test is to be parametrized over backends and run where the backend
exists. None is written yet: neither backend is available to test it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_trio.engine.attention.paged_reference import reference_paged_attention


def attend(queries: mx.array, cache: Any, scale: float) -> mx.array:
    """The attention of `queries` `[B, H, L, D]` over `cache`'s rows' blocks (its step's tables and lengths).

    Group by group (rows of similar table widths: `PagedStep.groups`), so the reference's gather pads a
    row at most to about twice its own blocks, never to the longest row of the batch.
    """
    step = cache.step
    keys, values = cache.block_keys, cache.block_values
    outs = [reference_paged_attention(queries if g.index is None else queries[g.index], keys, values, g.tables,
                                      g.lengths, scale) for g in step.groups]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out if step.restore is None else out[step.restore]
