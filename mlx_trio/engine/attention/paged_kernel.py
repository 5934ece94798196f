"""Decode attention over a paged cache's block tables on MLX's CUDA backend: each row's blocks read in place.

One query per row (`q [B, H, 1, D]`) against the pool's blocks
(`k`, `v`: `[N, block_size, Hkv, D]`, engine/kv/blocks/layer_cache.py), row
`b` attending to its positions `0 <= j < lengths[b]`, key `j` at
`k[tables[b, j // block_size], j % block_size]`: exactly the keys the MLX-ops
reference (paged_reference.py) gathers and keeps with its mask for one query.
Why: the reference gathers every row's blocks into a padded copy and builds a
mask each layer; on an H100 (Llama-1B, 64 rows of 512 tokens) its step cost
3.3x the padded step. This kernel gathers nothing and writes no scores.

The ragged kernel's algorithm (ragged_kernel.py: flash-decoding, a split pass
then its merge pass, which this module reuses as is), only the key's address
differs: one block per (split, kv head, row); each row's keys `[0, lengths[b])`
cut into `splits` chunks; a half warp holds one key (16 lanes, `D / 16`
elements each), read through the row's table; all `G = H / Hkv` query heads
of the kv head from that one read (GQA); online softmax in float32 (base 2,
the scale folded into log2(e)); the block's half warps merged in a fixed order
into per-split partials (output, max, sum), merged and divided by the second pass.

float16, bfloat16 and float32; D a multiple of 16 up to 256; `G * D / 16 <= 64`
(`ragged_kernel.supports`' limits). The pool is read through its strides
(`ensure_row_contiguous=False`): nothing is copied. Built on first use by NVRTC
(raises without MLX's CUDA backend). Lease thread only (builds lazy arrays).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mlx_trio.engine.attention import ragged_kernel
from mlx_trio.engine.attention.paged_reference import reference_paged_attention

# The ragged kernel's split pass; only a key's address differs: key j of row b is slot j % bs of block
# tables[b, j // bs] (the pool is read through its strides, nothing copied).
_SPLIT_SOURCE = ragged_kernel.split_source(
    key_range="""    const int bs = k_shape[1];      // the block size
    const int width = tables_shape[1];
    const int32_t* table = tables + (int64_t)b * tables_strides[0];
    int n_keys = lengths[b * lengths_strides[0]];
    n_keys = n_keys < 0 ? 0 : (n_keys > width * bs ? width * bs : n_keys);
    const int chunk = (n_keys + splits - 1) / splits;
    const int j_begin = split * chunk;
""",
    pointers="""    // This lane's elements of kv head `kvh` in block 0, slot 0; key j adds its block's and slot's offsets.
    const T* kp = k + (int64_t)kvh * k_strides[2] + (int64_t)(sub * EPT) * k_strides[3];
    const T* vp = v + (int64_t)kvh * v_strides[2] + (int64_t)(sub * EPT) * v_strides[3];
""",
    packed="""    // One load per lane where the layout allows (a pool's buffers always do); the same for the whole block.
    const bool packed = k_strides[3] == 1 && v_strides[3] == 1
        && k_strides[0] % EPT == 0 && k_strides[1] % EPT == 0 && v_strides[0] % EPT == 0 && v_strides[1] % EPT == 0
        && ((unsigned long long)kp % sizeof(Pack)) == 0 && ((unsigned long long)vp % sizeof(Pack)) == 0;
""",
    key_offsets="""        int64_t ko = 0;
        int64_t vo = 0;
        if (live[u]) {  // the key's block, through the row's table (j < n_keys <= width * bs)
          const int64_t blk = table[(int64_t)(j / bs) * tables_strides[1]];
          const int64_t at = j % bs;
          ko = blk * k_strides[0] + at * k_strides[1];
          vo = blk * v_strides[0] + at * v_strides[1];
        }
""",
    k_at="ko", v_at="vo")

# (name, inputs, outputs, source): read through strides (the pool is not copied).
KERNEL = ("paged_decode_split", ("q", "k", "v", "tables", "lengths"), ("part_o", "part_ml"), _SPLIT_SOURCE)


@functools.cache
def _split_kernel() -> Any:
    """The split pass, built on first use (raises without MLX's CUDA backend)."""
    name, inputs, outputs, source = KERNEL
    return mx.fast.cuda_kernel(name=name, input_names=list(inputs), output_names=list(outputs), source=source,
                               ensure_row_contiguous=False)


def supports(queries: mx.array, block_keys: mx.array, block_values: mx.array) -> bool:
    """Whether the kernel takes a decode step's queries over this pool (else the caller keeps the reference)."""
    if queries.ndim != 4 or block_keys.ndim != 4 or block_values.shape != block_keys.shape or queries.shape[2] != 1:
        return False
    H, D = queries.shape[1], queries.shape[3]
    _, bs, kv_heads, key_dim = block_keys.shape
    if key_dim != D or bs == 0 or kv_heads == 0 or H % kv_heads:
        return False
    if not (queries.dtype == block_keys.dtype == block_values.dtype and queries.dtype in ragged_kernel.DTYPES):
        return False
    # The ragged kernel's limits: one half warp per key, G * D / 16 registers for the queries and accumulators.
    return D % 16 == 0 and 16 <= D <= 256 and (H // kv_heads) * (D // 16) <= ragged_kernel.MAX_LANE_ELEMENTS


def paged_decode_attention(queries: mx.array, block_keys: mx.array, block_values: mx.array, tables: mx.array,
                           lengths: mx.array, scale: float, *, verbose: bool = False) -> mx.array:
    """softmax(scale * q k^T) v of each row's one query over its keys `0 <= j < lengths[b]`; `[B, H, 1, D]`.

    Contract: `supports(queries, block_keys, block_values)`; `tables` `[B, width]` integer block ids, valid
    for every block a row's length reaches; a row of length 0 gets zeros. `verbose` prints the CUDA source.
    """
    B, H, _, D = queries.shape
    bs, kv_heads = block_keys.shape[1], block_keys.shape[2]
    splits = ragged_kernel.splits_for(B, kv_heads, tables.shape[1] * bs)
    threads = 32 * ragged_kernel.WARPS
    tables = tables if tables.dtype == mx.int32 else tables.astype(mx.int32)
    lengths = lengths if lengths.dtype == mx.int32 else lengths.astype(mx.int32)
    split_template, merge_template = ragged_kernel.template_args(queries.dtype, D, H // kv_heads, scale)
    part_o, part_ml = _split_kernel()(
        inputs=[queries, block_keys, block_values, tables, lengths], template=split_template,
        grid=(splits * threads, kv_heads, B), threadgroup=(threads, 1, 1),
        output_shapes=[(B, H, splits, D), (B, H, splits, 2)], output_dtypes=[mx.float32, mx.float32],
        verbose=verbose)
    return ragged_kernel.merge_partials(part_o, part_ml, merge_template, queries.dtype, verbose=verbose)


def check_case(heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, lengths: list[int], block_size: int = 16,
               seed: int = 0) -> tuple[mx.array, ...]:
    """Random queries, a pool with spare blocks, shuffled tables (padded with a row's own first block) and lengths."""
    widths = [max(1, -(-n // block_size)) for n in lengths]
    pool = sum(widths) + 7
    k_q, k_k, k_v, k_p = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((len(lengths), heads, 1, head_dim), key=k_q).astype(dtype)
    k = mx.random.normal((pool, block_size, kv_heads, head_dim), key=k_k).astype(dtype)
    v = mx.random.normal((pool, block_size, kv_heads, head_dim), key=k_v).astype(dtype)
    order = mx.random.permutation(pool, key=k_p).tolist()
    rows, at = [], 0
    for w in widths:
        own = order[at : at + w]
        at += w
        rows.append(own + [own[0]] * (max(widths) - w))
    return q, k, v, mx.array(rows, dtype=mx.int32), mx.array(lengths, dtype=mx.int32)


def max_error(q: mx.array, k: mx.array, v: mx.array, tables: mx.array, lengths: mx.array, scale: float) -> float:
    """The kernel's max abs difference from the float32 reference (paged_reference.py) on these inputs."""
    got = paged_decode_attention(q, k, v, tables, lengths, scale).astype(mx.float32)
    want = reference_paged_attention(*(x.astype(mx.float32) for x in (q, k, v)), tables, lengths, scale)
    return mx.abs(got - want).max().item()


def self_check(heads: int, kv_heads: int, head_dim: int, scale: float, dtype: mx.Dtype = mx.bfloat16) -> str | None:
    """Build the kernel for this attention shape and compare it once with the reference; None, or what went wrong.

    Run at load on CUDA (routed_attention.install): a kernel that does not build or computes wrong values
    leaves paged decode steps on the reference. Three rows (300, 17 and 1 keys) over a shuffled pool.
    """
    q, k, v, tables, lengths = check_case(heads, kv_heads, head_dim, dtype, [300, 17, 1])
    if not supports(q, k, v):
        return f"the kernel does not take {heads}/{kv_heads} heads of {head_dim} in {dtype}"
    try:
        err = max_error(q, k, v, tables, lengths, scale)
    except Exception as exc:  # an NVRTC error surfaces here, at the first evaluation
        return f"the kernel did not build or run: {exc}"
    tolerance = ragged_kernel.SELF_CHECK_TOLERANCE
    return None if err <= tolerance else f"the kernel's max abs error {err:.3g} > {tolerance}"
