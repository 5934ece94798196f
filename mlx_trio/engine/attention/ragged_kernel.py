"""Decode attention over left-padded rows on MLX's CUDA backend: each row reads only its own keys.

One query per row (`q [B, H, 1, D]`) against keys and values `[B, Hkv, T, D]`,
row `b` attending to the positions `start[b] <= j < T` (`start`: the row's left
padding, exactly the positions mlx-lm's `create_causal_mask(1, ..., left_padding=)`
keeps for a decode step). Why: on MLX's CUDA backend an array mask takes a
decode step off the fused vector kernel onto the unfused fallback (matmul,
softmax, matmul, the scores written out; docs/design.md §4.6), over the padded
length, 16 layers a step. This kernel reads no padding and writes no scores.

Flash-decoding, two launches:

1. `ragged_decode_split`: one block per (split, kv head, row). Each row's own
   keys `[start, T)` are cut into `splits` equal chunks, one per block, so a
   lone row of 10k keys still fills the GPU. A block reads its chunk once for
   all `G = H / Hkv` query heads of its kv head (GQA). A half warp holds a key
   (16 lanes, `D / 16` elements each, one vector load), two keys loaded ahead
   per iteration; its lanes' dot products are summed by shuffles; each half
   warp keeps an online softmax (running max, sum and weighted values,
   float32) over the keys it read; the block merges its half warps in shared
   memory, in a fixed order, and writes a partial output, max and sum per
   query head.
2. `ragged_decode_merge`: one block per (row, head), one thread per element,
   merges the splits' partials (rescaled to the largest max) and divides by
   the sum.

float16, bfloat16 and float32 inputs; float32 arithmetic; D a multiple of 16
up to 256; `G * D / 16 <= 64` (the per-lane registers). Keys and values may be
a slice of a longer buffer: the kernel reads them through their strides
(`ensure_row_contiguous=False`), so the cache's `keys[..., :T, :]` is not copied.
Exponentials are base 2 with the scale folded into log2(e), as MLX's own kernels
do, so results match `mx.fast.scaled_dot_product_attention` to rounding, not bit
for bit (benchmarks/ragged_attention.py measures the error).

The kernels are built on first use (`mx.fast.cuda_kernel`, compiled by NVRTC on
the device, once per dtype / D / G / scale); on a machine without CUDA, building
raises. `scripts/nvrtc_check.py` compiles both passes with NVRTC on any machine
(no GPU: NVRTC and the CUDA headers come as wheels) and prints their registers
and spills. Lease thread only (builds lazy arrays).
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import mlx.core as mx

from mlx_trio.engine.attention.ragged_reference import reference_decode_attention

# Warps per block of the split pass: 4 keys per warp in flight (2 per half warp), 16 per block.
WARPS = 4
# The split pass aims at this many blocks in all (rows x kv heads x splits): a few per SM of an H100/H200.
TARGET_BLOCKS = 512
# A split holds at least this many keys (4 per half warp), and at most MAX_SPLIT_KEYS unless that would
# need more splits than TARGET_BLOCKS asks for anyway.
MIN_SPLIT_KEYS = 64
MAX_SPLIT_KEYS = 1024
# Per-lane registers: G query heads x D / 16 elements, for the queries and again for the accumulators.
MAX_LANE_ELEMENTS = 64
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# `self_check`'s bound against the float32 reference, in bfloat16 (outputs of about 1: its rounding is ~4e-3).
SELF_CHECK_TOLERANCE = 2e-2

# The split pass's source, less what addresses a key (`split_source` fills it in): this module's rows are
# positions of one padded buffer, paged_kernel.py's are blocks through a table. One algorithm, two layouts.
_SPLIT_TEMPLATE = """
#define NEG_INF (-__int_as_float(0x7f800000))  // MLX 0.32.4's kernel header defines no inf
    constexpr int LPK = 16;          // lanes sharing one key: a half warp
    constexpr int EPT = D / LPK;     // elements of the head dimension per lane
    constexpr int SLOTS = 2 * NW;    // keys a block reads at once, one per half warp
    const int split = blockIdx.x;
    const int splits = gridDim.x;
    const int kvh = blockIdx.y;
    const int b = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int hw = lane / LPK;      // which half warp (not `half`: cuda_fp16.h's type)
    const int sub = lane % LPK;
    const int slot = warp * 2 + hw;
    const int heads = q_shape[1];
@KEY_RANGE@    const int j_end = (j_begin + chunk < n_keys) ? j_begin + chunk : n_keys;
    const float qscale = __int_as_float(SCALE_BITS) * 1.4426950408889634f;

    float qr[G][EPT];
    float acc[G][EPT];
    float m[G];
    float l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const T* qp = q + (int64_t)b * q_strides[0] + (int64_t)(kvh * G + g) * q_strides[1]
                      + (int64_t)(sub * EPT) * q_strides[3];
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        qr[g][e] = static_cast<float>(qp[e * q_strides[3]]) * qscale;
        acc[g][e] = 0.0f;
      }
      m[g] = NEG_INF;
      l[g] = 0.0f;
    }
@POINTERS@    struct alignas(sizeof(T) * EPT) Pack {
      T x[EPT];
    };
@PACKED@
    // Both half warps run every iteration (the bound is the warp's), so the shuffles see all 32 lanes. Each
    // iteration loads two keys per half warp before using either: twice the loads in flight.
    for (int base = j_begin + 2 * warp; base < j_end; base += 2 * SLOTS) {
      float kr[2][EPT];
      float vr[2][EPT];
      bool live[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int j = base + hw + u * SLOTS;
        live[u] = j < j_end;
@KEY_OFFSETS@        if (live[u] && packed) {
          const Pack kx = *reinterpret_cast<const Pack*>(kp + @K_AT@);
          const Pack vx = *reinterpret_cast<const Pack*>(vp + @V_AT@);
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            kr[u][e] = static_cast<float>(kx.x[e]);
            vr[u][e] = static_cast<float>(vx.x[e]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            kr[u][e] = live[u] ? static_cast<float>(kp[@K_AT@ + e * k_strides[3]]) : 0.0f;
            vr[u][e] = live[u] ? static_cast<float>(vp[@V_AT@ + e * v_strides[3]]) : 0.0f;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float s = 0.0f;
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            s += qr[g][e] * kr[u][e];
          }
#pragma unroll
          for (int off = LPK / 2; off > 0; off /= 2) {
            s += __shfl_xor_sync(0xffffffffu, s, off);
          }
          if (live[u]) {
            const float top = fmaxf(m[g], s);
            const float c = exp2f(m[g] - top);
            const float p = exp2f(s - top);
            l[g] = l[g] * c + p;
#pragma unroll
            for (int e = 0; e < EPT; ++e) {
              acc[g][e] = acc[g][e] * c + p * vr[u][e];
            }
            m[g] = top;
          }
        }
      }
    }

    // Merge the block's half warps, in slot order (deterministic).
    __shared__ float sm_m[SLOTS * G];
    __shared__ float sm_l[SLOTS * G];
    __shared__ float sm_o[G * D];
    if (sub == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        sm_m[slot * G + g] = m[g];
        sm_l[slot * G + g] = l[g];
      }
    }
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
      sm_o[i] = 0.0f;
    }
    __syncthreads();
    for (int t = 0; t < SLOTS; ++t) {
      if (slot == t) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float top = NEG_INF;
          for (int u = 0; u < SLOTS; ++u) {
            top = fmaxf(top, sm_m[u * G + g]);
          }
          const float f = (m[g] == NEG_INF) ? 0.0f : exp2f(m[g] - top);
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            sm_o[g * D + sub * EPT + e] += acc[g][e] * f;
          }
        }
      }
      __syncthreads();
    }
    const int64_t head0 = (int64_t)b * heads + kvh * G;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
      const int g = i / D;
      const int d = i % D;
      part_o[((head0 + g) * splits + split) * D + d] = sm_o[i];
    }
    if (threadIdx.x < G) {
      const int g = threadIdx.x;
      float top = NEG_INF;
      for (int u = 0; u < SLOTS; ++u) {
        top = fmaxf(top, sm_m[u * G + g]);
      }
      float total = 0.0f;
      if (top != NEG_INF) {
        for (int u = 0; u < SLOTS; ++u) {
          const float mu = sm_m[u * G + g];
          if (mu != NEG_INF) {
            total += sm_l[u * G + g] * exp2f(mu - top);
          }
        }
      }
      part_ml[((head0 + g) * splits + split) * 2] = top;
      part_ml[((head0 + g) * splits + split) * 2 + 1] = total;
    }
"""


def split_source(*, key_range: str, pointers: str, packed: str, key_offsets: str, k_at: str, v_at: str) -> str:
    """The split pass for one key layout: `key_range` sets `n_keys`, `j_begin` and `chunk` (whole lines);
    `pointers` the lane's `kp`/`vp`; `packed` whether one load per lane fits the layout; `key_offsets` lines run per
    loaded key `j` (may be empty); `k_at`/`v_at` the offsets of key `j` from `kp`/`vp`."""
    fills = {"@KEY_RANGE@": key_range, "@POINTERS@": pointers, "@PACKED@": packed, "@KEY_OFFSETS@": key_offsets,
             "@K_AT@": k_at, "@V_AT@": v_at}
    source = _SPLIT_TEMPLATE
    for marker, text in fills.items():
        source = source.replace(marker, text)
    return source


_SPLIT_SOURCE = split_source(
    key_range="""    const int n_keys = k_shape[2];
    int first = start[b * start_strides[0]];
    first = first < 0 ? 0 : (first > n_keys ? n_keys : first);
    const int chunk = (n_keys - first + splits - 1) / splits;
    const int j_begin = first + split * chunk;
""",
    pointers="""    const T* kp = k + (int64_t)b * k_strides[0] + (int64_t)kvh * k_strides[1] + (int64_t)(sub * EPT) * k_strides[3];
    const T* vp = v + (int64_t)b * v_strides[0] + (int64_t)kvh * v_strides[1] + (int64_t)(sub * EPT) * v_strides[3];
    // A lane's EPT elements in one load where the layout allows (a cache's buffers always do); the same for
    // every lane of the block, so the branch below never diverges.
""",
    packed="""    const bool packed = k_strides[3] == 1 && v_strides[3] == 1 && k_strides[2] % EPT == 0 && v_strides[2] % EPT == 0
        && ((unsigned long long)kp % sizeof(Pack)) == 0 && ((unsigned long long)vp % sizeof(Pack)) == 0;
""",
    key_offsets="", k_at="j * k_strides[2]", v_at="j * v_strides[2]")

_MERGE_SOURCE = """
#define NEG_INF (-__int_as_float(0x7f800000))
    const int64_t bh = blockIdx.x;
    const int d = threadIdx.x;
    const int splits = part_ml_shape[2];
    const float* ml = part_ml + bh * splits * 2;
    const float* po = part_o + bh * splits * D + d;
    float top = NEG_INF;
    for (int s = 0; s < splits; ++s) {
      top = fmaxf(top, ml[2 * s]);
    }
    float total = 0.0f;
    float o = 0.0f;
    if (top != NEG_INF) {
      for (int s = 0; s < splits; ++s) {
        const float ms = ml[2 * s];
        if (ms != NEG_INF) {
          const float w = exp2f(ms - top);
          total += ml[2 * s + 1] * w;
          o += po[s * D] * w;
        }
      }
    }
    out[bh * D + d] = static_cast<T>(total > 0.0f ? o / total : 0.0f);
"""

# The two passes: (name, inputs, outputs, source, row-contiguous inputs). The split pass reads its inputs
# through their strides (a cache's keys are a slice of its buffer); the merge pass reads the split's outputs.
KERNELS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], str, bool]] = {
    "split": ("ragged_decode_split", ("q", "k", "v", "start"), ("part_o", "part_ml"), _SPLIT_SOURCE, False),
    "merge": ("ragged_decode_merge", ("part_o", "part_ml"), ("out",), _MERGE_SOURCE, True),
}

_kernels: dict[str, Any] = {}


def _kernel(which: str) -> Any:
    """The pass's kernel, built on first use (raises without MLX's CUDA backend)."""
    if which not in _kernels:
        name, inputs, outputs, source, contiguous = KERNELS[which]
        _kernels[which] = mx.fast.cuda_kernel(name=name, input_names=list(inputs), output_names=list(outputs),
                                              source=source, ensure_row_contiguous=contiguous)
    return _kernels[which]


def supports(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the kernel takes these shapes and dtypes (else the caller keeps MLX's attention)."""
    if queries.ndim != 4 or keys.ndim != 4 or values.shape != keys.shape or queries.shape[2] != 1:
        return False
    B, H, _, D = queries.shape
    if keys.shape[0] != B or keys.shape[3] != D or keys.shape[1] == 0 or H % keys.shape[1]:
        return False
    if not (queries.dtype == keys.dtype == values.dtype and queries.dtype in DTYPES):
        return False
    return D % 16 == 0 and 16 <= D <= 256 and (H // keys.shape[1]) * (D // 16) <= MAX_LANE_ELEMENTS


def splits_for(rows: int, kv_heads: int, n_keys: int) -> int:
    """How many chunks each row's keys are cut into (see TARGET_BLOCKS and the *_SPLIT_KEYS bounds)."""
    wanted = max(-(-n_keys // MAX_SPLIT_KEYS), -(-TARGET_BLOCKS // max(1, rows * kv_heads)))
    return max(1, min(wanted, -(-n_keys // MIN_SPLIT_KEYS)))


def _float_bits(x: float) -> int:
    """The float32 bit pattern of `x` as a signed int (the scale is a compile-time constant of the kernel)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


@functools.cache
def template_args(dtype: mx.Dtype, D: int, G: int, scale: float) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The split and merge passes' template arguments (built once per layer shape: this runs every layer, every step).

    MLX names the kernel after its template values (`custom_kernel_<name>_<value>...`, a C identifier), so
    the scale's bits must be a non-negative int: a positive scale's are.
    """
    if not scale > 0:
        raise ValueError(f"the ragged kernel takes a positive scale, not {scale}")
    return ([("T", dtype), ("D", D), ("G", G), ("NW", WARPS), ("SCALE_BITS", _float_bits(scale))],
            [("T", dtype), ("D", D)])


def ragged_decode_attention(queries: mx.array, keys: mx.array, values: mx.array, start: mx.array, scale: float,
                            *, verbose: bool = False) -> mx.array:
    """softmax(scale * q k^T) v over each row's keys `start[b] <= j < T`; `[B, H, 1, D]` in the queries' dtype.

    Contract: `supports(queries, keys, values)`; `start` an integer `[B]` array with
    `0 <= start[b] < T` for the rows whose output is used (a row with no key gets zeros).
    `verbose` prints the generated CUDA source (for reading an NVRTC error).
    """
    B, H, _, D = queries.shape
    kv_heads, n_keys = keys.shape[1], keys.shape[2]
    G = H // kv_heads
    splits = splits_for(B, kv_heads, n_keys)
    threads = 32 * WARPS
    if start.dtype != mx.int32:
        start = start.astype(mx.int32)
    split_template, merge_template = template_args(queries.dtype, D, G, scale)
    part_o, part_ml = _kernel("split")(
        inputs=[queries, keys, values, start], template=split_template,
        grid=(splits * threads, kv_heads, B), threadgroup=(threads, 1, 1),
        output_shapes=[(B, H, splits, D), (B, H, splits, 2)], output_dtypes=[mx.float32, mx.float32],
        verbose=verbose)
    return merge_partials(part_o, part_ml, merge_template, queries.dtype, verbose=verbose)


def merge_partials(part_o: mx.array, part_ml: mx.array, template: list[tuple[str, Any]], dtype: mx.Dtype,
                   *, verbose: bool = False) -> mx.array:
    """The merge pass: `[B, H, 1, D]` in `dtype` from a split pass's partials (the ragged and paged kernels')."""
    B, H, _, D = part_o.shape
    (out,) = _kernel("merge")(
        inputs=[part_o, part_ml], template=template,
        grid=(B * H * D, 1, 1), threadgroup=(D, 1, 1),
        output_shapes=[(B, H, 1, D)], output_dtypes=[dtype], verbose=verbose)
    return out


def self_check(heads: int, kv_heads: int, head_dim: int, scale: float, dtype: mx.Dtype = mx.bfloat16) -> str | None:
    """Build the kernel for this attention shape and compare it once with the reference; None, or what went wrong.

    Run at load on CUDA (engine/attention/routed_attention.py): a kernel that does not build
    (NVRTC) or computes wrong values then leaves the model on mlx-lm's attention instead of
    failing or corrupting requests. Two rows of 300 keys, one padded, keys a slice of a longer buffer.
    """
    k_q, k_k, k_v = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((2, heads, 1, head_dim), key=k_q).astype(dtype)
    k = mx.random.normal((2, kv_heads, 512, head_dim), key=k_k).astype(dtype)[..., :300, :]
    v = mx.random.normal((2, kv_heads, 512, head_dim), key=k_v).astype(dtype)[..., :300, :]
    start = mx.array([0, 117], dtype=mx.int32)
    if not supports(q, k, v):
        return f"the kernel does not take {heads}/{kv_heads} heads of {head_dim} in {dtype}"
    try:
        got = ragged_decode_attention(q, k, v, start, scale).astype(mx.float32)
        want = reference_decode_attention(*(x.astype(mx.float32) for x in (q, k, v)), start, scale)
        err = mx.abs(got - want).max().item()
    except Exception as exc:  # an NVRTC error surfaces here, at the first evaluation
        return f"the kernel did not build or run: {exc}"
    return None if err <= SELF_CHECK_TOLERANCE else f"the kernel's max abs error {err:.3g} > {SELF_CHECK_TOLERANCE}"
