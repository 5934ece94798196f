#!/usr/bin/env python3
"""Run the CUDA paged decode kernel's source (engine/attention/paged_kernel.py) with CuPy, on a GPU without MLX.

A correctness check of the source itself before a device run with MLX: the split pass (paged_kernel.py) and
the merge pass (ragged_kernel.py) read out of their files as text (no mlx import), wrapped in a plain signature
(each input's shape and strides as device arrays, which the bodies index as MLX's do), launched on the grids
`paged_decode_attention` uses, and compared with a numpy float32 reference over shuffled block tables. float16
and float32 (CuPy has no bfloat16). Exits 1 on a build error or an error past 2e-2.

Usage (on the device, with CuPy): python3 scripts/paged_kernel_cupy.py
"""

from __future__ import annotations

import math
import re
import struct
import sys
from pathlib import Path

import cupy as cp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent / "mlx_trio/engine/attention"


def _source(path: Path, name: str) -> str:
    return re.search(name + r' = """\n(.*?)"""', path.read_text(), re.S).group(1)


def _build(body: str, name: str, arrays: list[tuple[str, str]], consts: dict[str, object]) -> cp.RawKernel:
    params = []
    for arg, ctype in arrays:
        params.append(f"{ctype}* {arg}")
        if arg != "out":
            params += [f"const int* {arg}_shape", f"const long long* {arg}_strides"]
    lines = "".join(f"  using {k} = {v};\n" if isinstance(v, str) else f"  constexpr int {k} = {v};\n"
                    for k, v in consts.items())
    text = ("#include <cuda_fp16.h>\n#define int64_t long long\n#define int32_t int\n"
            f'extern "C" __global__ void {name}(' + ", ".join(params) + ") {\n" + lines + body + "\n}\n")
    return cp.RawKernel(text, name, options=("--std=c++17",))


def _meta(x: np.ndarray) -> list[cp.ndarray]:
    strides = np.array([s // x.itemsize for s in x.strides], np.int64)
    return [cp.asarray(np.array(x.shape, np.int32)), cp.asarray(strides)]


def run_case(dtype: type, heads: int, kv_heads: int, D: int, lengths: list[int], bs: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    B, G = len(lengths), heads // kv_heads
    widths = [max(1, -(-n // bs)) for n in lengths]
    pool = sum(widths) + 7
    q = rng.standard_normal((B, heads, 1, D)).astype(dtype)
    k = rng.standard_normal((pool, bs, kv_heads, D)).astype(dtype)
    v = rng.standard_normal((pool, bs, kv_heads, D)).astype(dtype)
    order, rows, at = rng.permutation(pool), [], 0
    for w in widths:
        own = [int(x) for x in order[at : at + w]]
        at += w
        rows.append(own + [own[0]] * (max(widths) - w))
    tables, lens = np.array(rows, np.int32), np.array(lengths, np.int32)
    scale = D**-0.5
    n_keys = tables.shape[1] * bs
    splits = max(1, min(max(-(-n_keys // 1024), -(-512 // (B * kv_heads))), -(-n_keys // 64)))
    ctype = "__half" if dtype == np.float16 else "float"
    bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    split = _build(_source(ROOT / "paged_kernel.py", "_SPLIT_SOURCE"), "split",
                   [("q", f"const {ctype}"), ("k", f"const {ctype}"), ("v", f"const {ctype}"), ("tables", "const int"),
                    ("lengths", "const int"), ("part_o", "float"), ("part_ml", "float")],
                   {"T": ctype, "D": D, "G": G, "NW": 4, "SCALE_BITS": bits})
    merge = _build(_source(ROOT / "ragged_kernel.py", "_MERGE_SOURCE"), "merge",
                   [("part_o", "const float"), ("part_ml", "const float"), ("out", ctype)], {"T": ctype, "D": D})
    part_o = np.zeros((B, heads, splits, D), np.float32)
    part_ml = np.zeros((B, heads, splits, 2), np.float32)
    d_po, d_pml = cp.asarray(part_o), cp.asarray(part_ml)
    args = []
    for x in (q, k, v, tables, lens):
        args += [cp.asarray(x), *_meta(x)]
    args += [d_po, *_meta(part_o), d_pml, *_meta(part_ml)]
    split((splits, kv_heads, B), (128,), tuple(args))
    out = cp.zeros((B, heads, 1, D), dtype)
    merge((B * heads,), (D,), (d_po, *_meta(part_o), d_pml, *_meta(part_ml), out))
    got = cp.asnumpy(out).astype(np.float32)
    want = np.zeros_like(got)
    for b, n in enumerate(lengths):
        keys = np.concatenate([k[t] for t in tables[b]])[:n].astype(np.float32)  # [n, Hkv, D]
        vals = np.concatenate([v[t] for t in tables[b]])[:n].astype(np.float32)
        for h in range(heads):
            s = keys[:, h // G] @ q[b, h, 0].astype(np.float32) * scale
            p = np.exp(s - s.max())
            want[b, h, 0] = (p / p.sum()) @ vals[:, h // G]
    return float(np.abs(got - want).max())


def main() -> int:
    failed = 0
    for dtype in (np.float16, np.float32):
        for heads, kv_heads, D in ((32, 8, 64), (32, 8, 128), (4, 2, 16)):
            for bs in (16, 32):
                for lengths in ([1, 17, 300, 2049, 64], [30000], [512] * 64):
                    try:
                        err = run_case(dtype, heads, kv_heads, D, lengths, bs, seed=len(lengths))
                    except Exception as exc:  # a build error
                        print(f"FAILED to build/run {dtype.__name__} {heads}/{kv_heads}x{D}: {exc}")
                        return 1
                    ok = math.isfinite(err) and err <= 2e-2
                    failed += not ok
                    print(f"{'ok' if ok else 'MISMATCH'} {dtype.__name__} {heads}/{kv_heads}x{D} bs={bs} "
                          f"B={len(lengths)} ({min(lengths)}..{max(lengths)}): max abs err {err:.2e}")
    print(f"{failed} mismatches" if failed else "every case matched")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
