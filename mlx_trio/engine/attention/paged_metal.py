"""Decode attention over a paged cache's block tables on Metal (`mx.fast.metal_kernel`): the CUDA kernel's job.

The same contract as paged_kernel.py (one query a row, row `b` attending to
`0 <= j < lengths[b]`, key `j` read in place at
`k[tables[b, j // block_size], j % block_size]`, online softmax in float32,
base 2 with the scale folded into log2(e)), in its simplest form: one
threadgroup per (kv head, row), no split over keys (one pass; a long lone row
is slower than it could be). A simdgroup (32 lanes, `D / 32` elements each)
holds one key at a time, its dot products summed by `simd_sum`, for all the
kv head's `G` query heads; the threadgroup's `NW` simdgroups take every
`NW`-th key and are merged in threadgroup memory, in a fixed order.

Not run on any machine yet (none with Metal was at hand): `routed_attention.install`
sets it only on Metal, only after `self_check` against the reference passed, else
logs why and keeps the reference. Lease thread only (builds lazy arrays).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mlx_trio.engine.attention import paged_kernel, ragged_kernel

# Simdgroups per threadgroup.
WARPS = 4

_SOURCE = """
    constexpr int EPT = D / 32;     // elements of the head dimension per lane
    const int kvh = threadgroup_position_in_grid.y;
    const int b = threadgroup_position_in_grid.z;
    const int sg = simdgroup_index_in_threadgroup;
    const int lane = thread_index_in_simdgroup;
    const int tid = thread_index_in_threadgroup;
    const int heads = q_shape[1];
    const int bs = k_shape[1];
    const int width = tables_shape[1];
    int n_keys = lengths[b * lengths_strides[0]];
    n_keys = n_keys < 0 ? 0 : (n_keys > width * bs ? width * bs : n_keys);
    const float qscale = as_type<float>(SCALE_BITS) * 1.4426950408889634f;

    float qr[G][EPT];
    float acc[G][EPT];
    float m[G];
    float l[G];
    for (int g = 0; g < G; ++g) {
      for (int e = 0; e < EPT; ++e) {
        const int64_t at = b * q_strides[0] + (kvh * G + g) * q_strides[1] + (lane * EPT + e) * q_strides[3];
        qr[g][e] = static_cast<float>(q[at]) * qscale;
        acc[g][e] = 0.0f;
      }
      m[g] = -INFINITY;
      l[g] = 0.0f;
    }
    for (int j = sg; j < n_keys; j += NW) {
      const int64_t blk = tables[b * tables_strides[0] + (j / bs) * tables_strides[1]];
      const int64_t ko = blk * k_strides[0] + (j % bs) * k_strides[1] + kvh * k_strides[2];
      const int64_t vo = blk * v_strides[0] + (j % bs) * v_strides[1] + kvh * v_strides[2];
      float kr[EPT];
      float vr[EPT];
      for (int e = 0; e < EPT; ++e) {
        kr[e] = static_cast<float>(k[ko + (lane * EPT + e) * k_strides[3]]);
        vr[e] = static_cast<float>(v[vo + (lane * EPT + e) * v_strides[3]]);
      }
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
        for (int e = 0; e < EPT; ++e) {
          s += qr[g][e] * kr[e];
        }
        s = simd_sum(s);
        const float top = max(m[g], s);
        const float c = exp2(m[g] - top);
        const float p = exp2(s - top);
        l[g] = l[g] * c + p;
        for (int e = 0; e < EPT; ++e) {
          acc[g][e] = acc[g][e] * c + p * vr[e];
        }
        m[g] = top;
      }
    }

    // Merge the simdgroups (each one's max, sum and weighted values), in simdgroup order.
    threadgroup float sm_m[NW * G];
    threadgroup float sm_l[NW * G];
    threadgroup float sm_o[NW * G * D];
    for (int g = 0; g < G; ++g) {
      if (lane == 0) {
        sm_m[sg * G + g] = m[g];
        sm_l[sg * G + g] = l[g];
      }
      for (int e = 0; e < EPT; ++e) {
        sm_o[(sg * G + g) * D + lane * EPT + e] = acc[g][e];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = tid; i < G * D; i += NW * 32) {
      const int g = i / D;
      const int d = i % D;
      float top = -INFINITY;
      for (int u = 0; u < NW; ++u) {
        top = max(top, sm_m[u * G + g]);
      }
      float total = 0.0f;
      float o = 0.0f;
      for (int u = 0; u < NW; ++u) {
        const float mu = sm_m[u * G + g];
        if (mu != -INFINITY) {
          const float w = exp2(mu - top);
          total += sm_l[u * G + g] * w;
          o += sm_o[(u * G + g) * D + d] * w;
        }
      }
      out[((int64_t)b * heads + kvh * G + g) * D + d] = static_cast<T>(total > 0.0f ? o / total : 0.0f);
    }
"""


@functools.cache
def _kernel() -> Any:
    """The kernel, built on first use (raises without Metal)."""
    return mx.fast.metal_kernel(name="paged_decode_metal", input_names=["q", "k", "v", "tables", "lengths"],
                                output_names=["out"], source=_SOURCE, ensure_row_contiguous=False)


def supports(queries: mx.array, block_keys: mx.array, block_values: mx.array) -> bool:
    """paged_kernel.supports' shapes, with D a multiple of 32 (a lane's share of a simdgroup's key)."""
    return paged_kernel.supports(queries, block_keys, block_values) and queries.shape[3] % 32 == 0


def paged_decode_attention(queries: mx.array, block_keys: mx.array, block_values: mx.array, tables: mx.array,
                           lengths: mx.array, scale: float, *, verbose: bool = False) -> mx.array:
    """paged_kernel.paged_decode_attention's contract, on Metal; shapes it does not take (`supports`: D not a multiple
    of 32) go to the reference."""
    if not supports(queries, block_keys, block_values):
        return paged_kernel.reference_paged_attention(queries, block_keys, block_values, tables, lengths, scale)
    B, H, _, D = queries.shape
    kv_heads = block_keys.shape[2]
    split_template, _ = ragged_kernel.template_args(queries.dtype, D, H // kv_heads, scale)
    template = [(name, value) for name, value in split_template if name != "NW"] + [("NW", WARPS)]
    (out,) = _kernel()(
        inputs=[queries, block_keys, block_values, tables.astype(mx.int32), lengths.astype(mx.int32)],
        template=template, grid=(32 * WARPS, kv_heads, B), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B, H, 1, D)], output_dtypes=[queries.dtype], verbose=verbose)
    return out


def self_check(heads: int, kv_heads: int, head_dim: int, scale: float, dtype: mx.Dtype = mx.bfloat16) -> str | None:
    """paged_kernel.self_check for this kernel: None, or what went wrong."""
    q, k, v, tables, lengths = paged_kernel.check_case(heads, kv_heads, head_dim, dtype, [300, 17, 1])
    if not supports(q, k, v):
        return f"the Metal kernel does not take {heads}/{kv_heads} heads of {head_dim} in {dtype}"
    try:
        got = paged_decode_attention(q, k, v, tables, lengths, scale).astype(mx.float32)
        want = paged_kernel.reference_paged_attention(*(x.astype(mx.float32) for x in (q, k, v)), tables, lengths,
                                                      scale)
        err = mx.abs(got - want).max().item()
    except Exception as exc:  # a Metal compile error surfaces here, at the first evaluation
        return f"the Metal kernel did not build or run: {exc}"
    tolerance = ragged_kernel.SELF_CHECK_TOLERANCE
    return None if err <= tolerance else f"the Metal kernel's max abs error {err:.3g} > {tolerance}"
