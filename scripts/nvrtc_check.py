#!/usr/bin/env python3
"""Compile the ragged and paged decode-attention kernels with NVRTC as MLX's `cuda_kernel` wraps it, on a machine without a GPU.

A check of the kernel's CUDA source (syntax, types, registers and spills for
sm_90) before a device run: engine/attention/ragged_kernel.py's two passes and paged_kernel.py's split,
wrapped the way MLX 0.32's `cuda_kernel` wraps a source (its default header,
the `mlx::core::cu` namespace, a `__global__ void custom_kernel_<name><template
values>(...)` signature with each input's `_shape` / `_strides` / `_ndim`
when the source names them, the template values as `using` / `constexpr`
lines), for bfloat16, float16 and float32 and the head shapes in `CASES`.

It needs NVRTC and the CUDA headers, which come as wheels (no GPU, no toolkit):
`nvidia-cuda-nvrtc` (libnvrtc.so), `nvidia-cuda-runtime` (cuda_fp16.h,
cuda_bf16.h, cooperative_groups.h) and CCCL (cuda/std/...: the `mlx-cuda-13`
wheel's mlx/include/cccl, or `nvidia-cuda-cccl`). MLX's own device header
(mlx/backend/cuda/device/utils.cuh) is built into libmlx, not shipped, so a
stand-in declaring the two types a signature uses (`Shape`, `Strides`) is
written to a temporary folder. Prints ptxas's register and spill lines; exits 1
if any source does not compile.

Usage:
    PYTHONPATH=$PWD python scripts/nvrtc_check.py --nvrtc DIR/nvidia/cu13/lib/libnvrtc.so.13 \\
        --include DIR/nvidia/cu13/include --include DIR/mlx/include/cccl [--arch sm_90] [--show-source]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from mlx_trio.engine.attention import paged_kernel, ragged_kernel

# (query heads, kv heads, head dim): the Llama-1B and -8B shapes, GQA 8:1 at D=128, and the tiny models'.
CASES = ((32, 8, 64), (32, 8, 128), (64, 8, 128), (4, 2, 16))
CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.int32: "int32_t"}
# MLX's default header for a custom kernel as MLX 0.32.4 on the H200 generated it (no `inf`: a kernel that
# used it failed there with "identifier inf is undefined", 2026-12-01).
DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

"""
STAND_IN_UTILS = """#pragma once
// A stand-in for MLX's utils.cuh: only what a custom kernel's signature uses.
#ifndef MAX_NDIM
#define MAX_NDIM 10
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""


def wrap(which: str, input_dtypes: dict[str, mx.Dtype], output_dtypes: dict[str, mx.Dtype],
         template: list[tuple[str, object]]) -> tuple[str, str]:
    """(kernel name, full source) as MLX builds them for `ragged_kernel.KERNELS[which]` or ("paged") the paged split."""
    name, inputs, outputs, source = paged_kernel.KERNEL if which == "paged" else ragged_kernel.KERNELS[which][:4]
    suffix = "".join("_" + (str(v).rsplit(".", 1)[-1] if isinstance(v, mx.Dtype) else str(v)) for _, v in template)
    func = f"custom_kernel_{name}{suffix}"
    params = []
    for arg in inputs:
        params.append(f"    const {CUDA_TYPES[input_dtypes[arg]]}* {arg}")
        for info, kind in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
            if f"{arg}_{info}" in source:
                params.append(f"    const __grid_constant__ {kind} {arg}_{info}")
    params += [f"    {CUDA_TYPES[output_dtypes[arg]]}* {arg}" for arg in outputs]
    constants = "".join(f"  using {k} = {CUDA_TYPES[v]};\n" if isinstance(v, mx.Dtype) else f"  constexpr int {k} = {v};\n"
                        for k, v in template)
    text = (DEFAULT_HEADER + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {func}(\n" + ",\n".join(params) + ") {\n" + constants + "\n" + source
            + "\n}\n\n} // namespace mlx::core::cu\n")
    return func, text


def compile_source(nvrtc: ctypes.CDLL, text: str, options: list[str]) -> tuple[int, str]:
    """NVRTC's status and log for one source."""
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"kernel.cu", 0, None, None) != 0:
        return -1, "nvrtcCreateProgram failed"
    opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
    status = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return status, log.value.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvrtc", required=True, help="libnvrtc.so (the nvidia-cuda-nvrtc wheel's)")
    p.add_argument("--include", action="append", default=[], help="an include folder (CUDA headers, CCCL)")
    p.add_argument("--arch", default="sm_90", help="NVRTC's -arch (sm_90: the H100/H200)")
    p.add_argument("--show-source", action="store_true", help="print each generated source")
    args = p.parse_args(argv)
    nvrtc = ctypes.CDLL(args.nvrtc)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="nvrtc-check-") as tmp:
        utils = Path(tmp, "mlx/backend/cuda/device/utils.cuh")
        utils.parent.mkdir(parents=True)
        utils.write_text(STAND_IN_UTILS)
        options = ["--std=c++17", f"-arch={args.arch}", f"-I{tmp}", *(f"-I{d}" for d in args.include)]
        if args.arch.startswith("sm_"):
            options.append("--ptxas-options=-v")
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            for H, Hkv, D in CASES:
                split, merge = ragged_kernel.template_args(dtype, D, H // Hkv, D**-0.5)
                for which, ins, outs, template in (
                        ("split", {"q": dtype, "k": dtype, "v": dtype, "start": mx.int32},
                         {"part_o": mx.float32, "part_ml": mx.float32}, split),
                        ("merge", {"part_o": mx.float32, "part_ml": mx.float32}, {"out": dtype}, merge),
                        ("paged", {"q": dtype, "k": dtype, "v": dtype, "tables": mx.int32, "lengths": mx.int32},
                         {"part_o": mx.float32, "part_ml": mx.float32}, split)):
                    func, text = wrap(which, ins, outs, template)
                    if args.show_source:
                        print(text)
                    status, log = compile_source(nvrtc, text, options)
                    usage = [line.removeprefix("ptxas").split(":", 1)[-1].strip(" .") for line in log.splitlines()
                             if "registers" in line or "spill" in line]
                    print(f"{'ok' if status == 0 else 'FAILED'}  {func}: {'; '.join(usage)}")
                    if status != 0:
                        failed += 1
                        print(log)
    print(f"{failed} of the sources did not compile" if failed else "every source compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
