"""Fused q/k/v and gate/up projections compute bit for bit what mlx-lm's separate ones do, and stay off where they must.

On the CPU every output element of the fused matmul is the same dot product as
the separate one's, so the fused model's logits must equal the unfused model's
exactly: for a prefill, for one-token steps, and over a padded batch schedule
with joins and leaves (mlx_trio/testing/batch_reference.py), for llama, qwen2
(q/k/v biases), qwen3 (q/k norms), the sliding-window llama and a 4-bit
quantized llama. The goldens (tests/engine/test_goldens.py) run with fusion on,
its default.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio import open_engine
from mlx_trio.engine.adapters.row_lora import RowLoraLinear, RowSelection
from mlx_trio.engine.attention import routed_attention
from mlx_trio.engine.attention.ragged_reference import reference_decode_attention
from mlx_trio.engine.attention.routed_attention import RoutedAttention
from mlx_trio.engine.distributed.world import World
from mlx_trio.engine.kv.layout import weights_bytes
from mlx_trio.engine.model import draft_model, fused_projections, load as load_module
from mlx_trio.engine.model.fused_projections import Fused, FusedMLP
from mlx_trio.engine.model.load import load_model
from mlx_trio.params import SamplingParams
from mlx_trio.testing import batch_reference as ref
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, TinyModelSpec, tiny_model
from tests.engine.adapters.test_row_lora import _adapter_dir

SPECS = {"llama": LLAMA, "qwen3": QWEN3, "qwen2": TinyModelSpec("qwen2"), "llama_swa": LLAMA_SWA}
# Rows of very different lengths, joining mid-decode and leaving: padded steps, prefill chunks, one-token steps.
SCHEDULE = [(0, 40, 14), (1, 3, 12), (2, 90, 8), (4, 7, 10), (6, 25, 9), (9, 1, 11)]
PROMPT = [5, 7, 9, 11, 200, 3, 17, 42, 8, 99, 100, 4]


@cache
def _path(name: str) -> str:
    return str(tiny_model(SPECS[name]))


def _plain(name: str, *, quantize: Any = None) -> nn.Module:
    """mlx-lm's model as mlx-lm loads it, wrapped by `routed_attention.install` (route unset on the CPU)."""
    model = load(_path(name))[0]
    if quantize is not None:
        nn.quantize(model, group_size=32, bits=4, class_predicate=quantize)
        mx.eval(model.parameters())
    routed_attention.install(model)
    return model


def _fused(name: str, *, quantize: Any = None) -> tuple[nn.Module, Fused]:
    model = _plain(name, quantize=quantize)
    return model, fused_projections.fuse(model)


def _quantize_all(path: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and "lm_head" not in path


def _arrivals() -> list[ref.Arrival]:
    return [ref.Arrival(f"r{i}", at, tuple((11 * i + 5 * j + j * j) % 509 + 3 for j in range(n)),
                        SamplingParams(max_tokens=m)) for i, (at, n, m) in enumerate(SCHEDULE)]


def _schedule(model: nn.Module) -> ref.Replay:
    return ref.run_schedule(ref.ours(model, prefill_step_size=8), _arrivals(), eos=(), max_batch=8)


def _solo_logits(model: nn.Module) -> list[mx.array]:
    """The prefill's logits, then eight greedy one-token steps' logits."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=cache)
    out = [logits]
    for _ in range(8):
        token = mx.argmax(logits[:, -1, :], axis=-1)
        logits = model(token[:, None], cache=cache)
        out.append(logits)
    mx.eval(out)
    return out


def _is_fused(model: nn.Module) -> bool:
    layers = model.layers
    return all(isinstance(l.self_attn, RoutedAttention) and l.self_attn.fused and isinstance(l.mlp, FusedMLP)
               for l in layers)


def _has_separate_projections(model: nn.Module) -> bool:
    return all({"q_proj", "k_proj", "v_proj"} <= set(l.self_attn.keys())
               and {"gate_proj", "up_proj"} <= set(l.mlp.keys()) for l in model.layers)


@pytest.mark.parametrize("name", list(SPECS))
def test_every_layer_fuses_into_four_matmuls_with_the_same_weights(name: str) -> None:
    plain = _plain(name)
    model, fused = _fused(name)
    assert fused == Fused(len(model.layers), len(model.layers))
    assert _is_fused(model) and _has_separate_projections(plain)
    attention, want = model.layers[0].self_attn, plain.layers[0].self_attn
    assert not {"q_proj", "k_proj", "v_proj"} & set(attention.keys())
    assert mx.array_equal(attention.qkv_proj.weight, mx.concatenate(
        [want.q_proj.weight, want.k_proj.weight, want.v_proj.weight]))
    assert ("bias" in attention.qkv_proj) == (name == "qwen2")  # qwen2's attention biases are concatenated too
    assert weights_bytes(model) == weights_bytes(plain)  # the originals are replaced, not kept
    assert fused_projections.fuse(model) == Fused(0, 0)  # a second pass leaves fused layers alone


@pytest.mark.parametrize("name", list(SPECS))
def test_fused_logits_are_bit_identical_for_a_prefill_and_one_token_steps(name: str) -> None:
    got, want = _solo_logits(_fused(name)[0]), _solo_logits(_plain(name))
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name", list(SPECS))
def test_fused_padded_batch_schedule_is_bit_identical(name: str) -> None:
    """Joins, leaves, padded one-token steps and 8-token prefill chunks: same greedy tokens, logits equal exactly."""
    got, want = _schedule(_fused(name)[0]), _schedule(_plain(name))
    assert got.tokens == want.tokens
    diffs = ref.logit_diffs(got, want)
    assert diffs and max(diffs.values()) == 0.0


def test_fused_routed_steps_are_bit_identical() -> None:
    """With the ragged route set (the CUDA kernel's place, here its CPU reference), fused equals unfused too."""
    runs = []
    for model in (_fused("qwen2")[0], _plain("qwen2")):
        routed_attention.route_of(model).attend = reference_decode_attention
        runs.append(_schedule(model))
    assert runs[0].tokens == runs[1].tokens and max(ref.logit_diffs(*runs).values()) == 0.0


def test_quantized_projections_fuse_and_stay_bit_identical() -> None:
    """A 4-bit model: weight, scales and biases concatenated by output rows, one QuantizedLinear of the same settings."""
    model, fused = _fused("llama", quantize=_quantize_all)
    plain = _plain("llama", quantize=_quantize_all)
    assert fused == Fused(len(model.layers), len(model.layers))
    qkv = model.layers[0].self_attn.qkv_proj
    assert type(qkv) is nn.QuantizedLinear and (qkv.bits, qkv.group_size, qkv.mode) == (4, 32, "affine")
    assert weights_bytes(model) == weights_bytes(plain)
    assert all(mx.array_equal(a, b).item() for a, b in zip(_solo_logits(model), _solo_logits(plain), strict=True))


def _more_bits_for_v(path: str, module: nn.Module) -> bool | dict[str, int]:
    """As mlx-lm's mixed recipes do: v_proj at 8 bits, the rest at 4."""
    return _quantize_all(path, module) and ({"group_size": 32, "bits": 8} if "v_proj" in path else True)


@pytest.mark.parametrize("predicate", ["more-bits-for-v", "v-only"])
def test_mixed_quantization_stays_unfused_with_the_reason(predicate: str) -> None:
    """q/k/v of different bits, or some quantized and some not: the attention stays apart, the MLP fuses."""
    v_only = lambda path, m: _quantize_all(path, m) and "q_proj" not in path and "k_proj" not in path  # noqa: E731
    model, fused = _fused("llama", quantize=_more_bits_for_v if predicate == "more-bits-for-v" else v_only)
    assert fused.attention == 0 and fused.mlp == len(model.layers)
    reason = "mixed quantization" if predicate == "more-bits-for-v" else "not all Linear or all QuantizedLinear"
    assert len(fused.unfused) == 1 and reason in fused.unfused[0]
    assert all(not l.self_attn.fused for l in model.layers)


def test_a_wrapped_projection_stays_unfused() -> None:
    """An adapter's wrapper (or any other layer type) in q_proj's place is not a Linear: that layer stays apart."""
    model = _plain("llama")
    attention = model.layers[0].self_attn
    attention.q_proj = RowLoraLinear(attention.q_proj, RowSelection(), None)  # type: ignore[arg-type]
    fused = fused_projections.fuse(model)
    assert fused.attention == len(model.layers) - 1 and fused.mlp == len(model.layers)
    assert not attention.fused and "RowLoraLinear" in fused.unfused[0]


def test_projections_of_unexpected_shapes_stay_unfused() -> None:
    model = _plain("llama")
    model.layers[1].self_attn.n_kv_heads = 1  # k/v_proj rows no longer kv_heads * head_dim
    fused = fused_projections.fuse(model)
    assert fused.attention == len(model.layers) - 1 and not model.layers[1].self_attn.fused
    assert "are not heads 4 / kv heads 1" in fused.unfused[0]


def test_unrouted_attention_and_other_mlps_stay_as_mlx_lm_made_them() -> None:
    """Without the routed attention (its kill switch) q/k/v stay apart; another architecture's MLP is not touched."""
    model = load(_path("llama"))[0]  # no routed_attention.install
    fused = fused_projections.fuse(model)
    assert fused.attention == 0 and fused.mlp == len(model.layers)
    assert fused.unfused == ("attention: mlx_lm.models.llama.Attention is not routed attention",)
    hybrid = ref.tiny_qwen3_next()
    fused = fused_projections.fuse(hybrid)
    assert fused.attention == fused.mlp == 0


def test_kill_switch_loads_todays_modules_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fused_projections.KILL_SWITCH, "1")
    killed = load_model(_path("qwen3")).model
    monkeypatch.delenv(fused_projections.KILL_SWITCH)
    off = load_model(_path("qwen3"), fuse_projections=False).model
    on = load_model(_path("qwen3")).model
    assert _is_fused(on) and _has_separate_projections(killed)
    assert [type(m).__qualname__ for _, m in killed.named_modules()] == [type(m).__qualname__ for _, m in off.named_modules()]
    assert [(k, v.shape) for k, v in tree_flatten(killed.parameters())] == \
        [(k, v.shape) for k, v in tree_flatten(off.parameters())]


def test_a_distributed_rank_keeps_separate_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    """shard() and pipeline() replace projections by name: a rank of a group loads them unfused."""
    monkeypatch.setattr(load_module, "current_world", lambda: World(rank=0, size=2, backend="ring", host="h"))
    monkeypatch.setattr(load_module, "shard_model", lambda model, world: None)
    assert _has_separate_projections(load_model(_path("llama")).model)


def test_the_draft_model_loads_unfused() -> None:
    target = load(_path("llama"))
    draft = draft_model.load_draft_model(_path("llama"), target[1])
    assert _has_separate_projections(draft)


async def test_an_engine_serving_adapters_keeps_separate_projections() -> None:
    """Adapters wrap q_proj/v_proj when they load, at start or at run time: such an engine never fuses."""
    async with open_engine(_path("llama"), lora_modules={"qv": str(_adapter_dir("llama", "qv"))}) as engine:
        assert _has_separate_projections(engine.model.model)
        await engine.complete([5, 7, 9], model="qv", max_tokens=2)  # its first row wraps the layers it touches
        assert all(isinstance(l.self_attn.q_proj, RowLoraLinear) for l in engine.model.model.layers)
    async with open_engine(_path("llama"), enable_lora_admin=True) as engine:
        assert _has_separate_projections(engine.model.model)
    async with open_engine(_path("llama")) as engine:
        assert _is_fused(engine.model.model)
