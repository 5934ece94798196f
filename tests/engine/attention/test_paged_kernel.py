"""The paged decode kernel against the MLX-ops reference, per backend (skipped where the backend is absent),
and the wiring that sends decode steps (only) to a kernel, which runs on every backend.

The CUDA kernel (engine/attention/paged_kernel.py) needs MLX's CUDA backend (run on an H100/H200), the Metal
one (paged_metal.py) a Mac; neither has run yet.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_trio.engine.attention import paged_attention, paged_kernel, paged_metal, ragged_kernel
from mlx_trio.engine.attention.paged_reference import reference_paged_attention


def _cuda() -> bool:
    return mx.cuda.is_available()


# Each backend's kernel, and whether it can run here.
BACKENDS = [pytest.param("cuda", marks=pytest.mark.skipif(not _cuda(), reason="MLX's CUDA backend is absent")),
            pytest.param("metal", marks=pytest.mark.skipif(not mx.metal.is_available(), reason="Metal is absent"))]
KERNELS = {"cuda": paged_kernel.paged_decode_attention, "metal": paged_metal.paged_decode_attention}
CHECKS = {"cuda": paged_kernel.self_check, "metal": paged_metal.self_check}


@pytest.fixture
def gpu():
    with mx.stream(mx.gpu):
        yield


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 64), (32, 8, 128), (8, 8, 64), (4, 2, 16)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_reference(gpu, backend: str, dtype: mx.Dtype, heads: int, kv_heads: int, head_dim: int,
                                  block_size: int) -> None:
    lengths = [1, 17, 300, 2049, 64]
    q, k, v, tables, lens = paged_kernel.check_case(heads, kv_heads, head_dim, dtype, lengths, block_size, seed=3)
    scale = head_dim**-0.5
    got = KERNELS[backend](q, k, v, tables, lens, scale).astype(mx.float32)
    want = reference_paged_attention(*(x.astype(mx.float32) for x in (q, k, v)), tables, lens, scale)
    assert got.shape == (len(lengths), heads, 1, head_dim)
    bound = ragged_kernel.SELF_CHECK_TOLERANCE  # float32 too: the ragged kernel was 1.6e-3 off on an H200
    assert mx.abs(got - want).max().item() <= bound


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_check_passes(gpu, backend: str) -> None:
    assert CHECKS[backend](32, 8, 64, 0.125) is None
    assert CHECKS[backend](32, 8, 128, 128**-0.5) is None


def _cache(lengths: list[int], L: int, heads: int = 4, kv_heads: int = 2, D: int = 16):
    """A stand-in for a `PagedLayerCache`: its pool and a step of one group (all rows, in order)."""
    q, k, v, tables, lens = paged_kernel.check_case(heads, kv_heads, D, mx.float32, lengths, seed=1)
    q = mx.random.normal((len(lengths), heads, L, D), key=mx.random.key(2))
    group = SimpleNamespace(index=None, tables=tables, lengths=lens, visible=None, key_slots=None)
    return q, SimpleNamespace(step=SimpleNamespace(groups=(group,), restore=None), block_keys=k, block_values=v)


def test_decode_steps_go_to_the_kernel_and_prefill_chunks_to_the_reference() -> None:
    calls = []

    def kernel(*args):
        calls.append(args[0].shape)
        return reference_paged_attention(*args)

    q, cache = _cache([40, 7], L=1)
    want = paged_attention.attend(q, cache, 0.25)
    assert calls == []
    assert mx.array_equal(paged_attention.attend(q, cache, 0.25, kernel), want)
    assert calls == [(2, 4, 1, 16)]
    q, cache = _cache([40, 7], L=3)
    paged_attention.attend(q, cache, 0.25, kernel)
    assert calls == [(2, 4, 1, 16)]  # two rows of one group with several queries each: the reference


def test_the_kernel_is_not_taken_for_shapes_it_cannot_run() -> None:
    q, cache = _cache([40], L=1, D=8)  # D not a multiple of 16
    assert not paged_kernel.supports(q, cache.block_keys, cache.block_values)
    assert mx.array_equal(paged_attention.attend(q, cache, 0.25, lambda *a: 1 / 0),
                          paged_attention.attend(q, cache, 0.25))


@pytest.mark.skipif(_cuda() or mx.metal.is_available(), reason="checks the fallback where no GPU backend exists")
def test_without_cuda_the_self_check_says_why_and_install_leaves_the_reference() -> None:
    assert "did not build or run" in paged_kernel.self_check(32, 8, 64, 0.125)
    assert "did not build or run" in paged_metal.self_check(32, 8, 64, 0.125)
    from mlx_lm import load

    from mlx_trio.engine.attention import routed_attention
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model

    installed = routed_attention.install(load(str(tiny_model(LLAMA)))[0])
    assert installed.route is not None and installed.route.paged_decode is None and installed.paged_off is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_through_the_kernel_equal_mlx_lm_generate_step(backend: str) -> None:
    """The tiny llama (float32, so `install` keeps the reference) with its paged decode steps forced onto the kernel."""
    from mlx_trio.engine.attention import routed_attention
    from tests.engine.attention import test_paged_model as paged

    route = routed_attention.route_of(paged._model("llama"))
    route.paged_decode = KERNELS[backend]
    try:
        kv = paged._kv("llama", 16)
        for seed, n in ((0, 1), (1, 17), (2, 45)):
            prompt = paged._prompt(seed, n)
            assert paged._alone(kv, "llama", prompt, 12, 64) == paged._golden("llama", prompt, 12), (seed, n)
        paged._assert_idle(kv)
    finally:
        route.paged_decode = None
