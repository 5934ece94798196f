"""The lean decode forward computes bit for bit what the model's own forward does, with fewer graph nodes.

`DecodeForward` (engine/model/decode_forward.py) replaces `model(tokens[:, None],
cache=caches)[:, -1, :]` in `DecodeBatch`'s steps. On the CPU its logits must
equal the model's exactly: for a lone row on mlx-lm's caches, and over a padded
batch with joins and leaves (tokens and sampled logprobs equal), for llama,
qwen2 (q/k/v biases), qwen3 (q/k norms), the sliding-window llama, a 4-bit
llama and a tied LM head, with the ragged route set or not. Where the model is
not one it reproduces (unfused, wrapped, the kill switch) it is not used.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.attention import routed_attention
from mlx_trio.engine.attention.ragged_reference import reference_decode_attention
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.model import decode_forward
from mlx_trio.engine.model.decode_forward import DecodeForward
from mlx_trio.params import SamplingParams
from mlx_trio.testing import batch_reference as ref
from tests.engine.model.test_fused_projections import SPECS, _fused, _plain, _quantize_all

PROMPT = [5, 7, 9, 11, 200, 3, 17, 42, 8, 99, 100, 4]


def _model(kind: str) -> nn.Module:
    if kind == "llama-4bit":
        return _fused("llama", quantize=_quantize_all)[0]
    if kind == "llama-tied":
        model = _fused("llama")[0]
        model.args.tie_word_embeddings = True  # the same model object steps both ways: only the head's path changes
        del model["lm_head"]
        return model
    return _fused(kind)[0]


KINDS = [*SPECS, "llama-4bit", "llama-tied"]


@pytest.mark.parametrize("kind", KINDS)
def test_lone_row_steps_are_bit_identical(kind: str) -> None:
    """Two copies of one prefilled cache: eight greedy steps, lean vs the model, logits equal exactly."""
    model = _model(kind)
    lean = DecodeForward.of(model)
    assert lean is not None, decode_forward.why_not(model)
    caches = [make_prompt_cache(model) for _ in range(2)]
    for cache in caches:
        mx.eval(model(mx.array([PROMPT]), cache=cache))
    token = mx.array([PROMPT[-1]])
    for _ in range(8):
        got = lean(token, caches[0])
        want = model(token[:, None], cache=caches[1])[:, -1, :]
        assert got.shape == want.shape and mx.array_equal(got, want).item()
        token = mx.argmax(got, axis=-1)


def _row(model: nn.Module, i: int, length: int) -> tuple[SoloRow, int]:
    prompt = [(11 * i + 5 * j + j * j) % 509 + 3 for j in range(length)]
    row = SoloRow(model, f"r{i}", prompt, SamplingParams(max_tokens=1000, logprobs=True, top_logprobs=3))
    while row.prefill_chunk():
        pass
    return row, row.first_token()


def _drive(model: nn.Module, monkeypatch: pytest.MonkeyPatch, *, lean: bool) -> list[Any]:
    """Three rows, two joiners, a leaver: every step's tokens and logprobs."""
    if lean:
        monkeypatch.delenv(decode_forward.KILL_SWITCH, raising=False)
    else:
        monkeypatch.setenv(decode_forward.KILL_SWITCH, "1")
    batch = DecodeBatch(model)
    monkeypatch.delenv(decode_forward.KILL_SWITCH, raising=False)
    out: list[Any] = []
    batch.join_many([_row(model, i, n) for i, n in enumerate((3, 17, 9))])
    out += [batch.step_decoded() for _ in range(5)]
    out.append(batch.flush_decoded())
    batch.join_many([_row(model, i, n) for i, n in ((3, 30), (4, 1))])
    out += [batch.step_decoded() for _ in range(5)]
    batch.leave(["r1"])
    out += [batch.step_decoded() for _ in range(5)]
    out.append(batch.flush_decoded())
    batch.close()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_with_joins_and_leaves_is_bit_identical(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(kind)
    got, want = _drive(model, monkeypatch, lean=True), _drive(model, monkeypatch, lean=False)
    assert got == want
    assert any(d is not None and d.logprobs[0] is not None for d in got)  # the logprobs took part


def test_routed_padded_batch_is_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the ragged route set (the CUDA kernel's place, here its CPU reference) the lean step takes it too."""
    model = _model("qwen3")
    routed_attention.route_of(model).attend = reference_decode_attention
    assert _drive(model, monkeypatch, lean=True) == _drive(model, monkeypatch, lean=False)


def _primitives(arrays: list[mx.array], path: Path) -> collections.Counter[str]:
    mx.export_to_dot(str(path), *arrays)
    return collections.Counter(re.findall(r'\[label ="([^"]*)", shape=rectangle\]', path.read_text()))


def test_the_lean_step_graph_drops_the_transposes_and_flattens(tmp_path: Path) -> None:
    """Per layer: 4 weight transposes, 4 flatten/unflatten pairs around matmuls and 4 q/k/v/output transposes fewer.

    (On the CPU, MLX's attention fallback keeps its own transposes and flattens; on CUDA it is one kernel.)
    """
    model = _model("llama")
    lean = DecodeForward.of(model)
    assert lean is not None
    caches = [make_prompt_cache(model) for _ in range(2)]
    for cache in caches:
        mx.eval(model(mx.array([PROMPT]), cache=cache))
    token = mx.array([PROMPT[-1]])
    got = _primitives([lean(token, caches[0])], tmp_path / "lean.dot")
    want = _primitives([model(token[:, None], cache=caches[1])[:, -1, :]], tmp_path / "model.dot")
    layers = len(model.layers)
    assert got["Flatten"] <= want["Flatten"] - 4 * layers and got["Unflatten"] <= want["Unflatten"] - 4 * layers
    assert got["Transpose"] <= want["Transpose"] - 8 * layers
    assert got["Matmul"] == want["Matmul"]
    assert sum(got.values()) <= sum(want.values()) - 16 * layers


def test_models_it_does_not_reproduce_step_through_their_own_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    unfused = _plain("llama")
    assert DecodeForward.of(unfused) is None
    assert "not fused" in (decode_forward.why_not(unfused) or "")
    recorder = ref.RecordingModel(_model("llama"))  # a wrapper: not the family's Model class
    assert DecodeForward.of(recorder) is None  # type: ignore[arg-type]
    hybrid = ref.tiny_qwen3_next()
    assert DecodeForward.of(hybrid) is None
    monkeypatch.setenv(decode_forward.KILL_SWITCH, "1")
    assert DecodeForward.of(_model("llama")) is None


def test_a_replaced_weight_is_transposed_again() -> None:
    """The transposed view follows the layer's weight array, so a weight swapped after build is the one used."""
    model = _model("llama")
    lean = DecodeForward.of(model)
    assert lean is not None
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    token = mx.array([PROMPT[-1]])
    mx.eval(lean(token, make_prompt_cache(model)))  # built its views
    head = model.lm_head
    head.weight = head.weight * 2
    fresh = [make_prompt_cache(model) for _ in range(2)]
    for c in fresh:
        mx.eval(model(mx.array([PROMPT]), cache=c))
    assert mx.array_equal(lean(token, fresh[0]), model(token[:, None], cache=fresh[1])[:, -1, :]).item()
