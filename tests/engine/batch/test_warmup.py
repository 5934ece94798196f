"""The load-time warm-up takes every cache kind through the batch lane and leaves nothing behind."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from mlx_trio.engine.batch.warmup import warm_up

from tests.engine.batch.test_batch_join_many import _model


@pytest.mark.parametrize("compile_decode", [False, True], ids=["uncompiled", "compiled"])
@pytest.mark.parametrize("name", ["llama", "llama_swa", "qwen3_next"])
def test_warm_up_runs_every_cache_kind_and_frees_its_arrays(name: str, compile_decode: bool) -> None:
    model, vocab = _model(name)
    mx.eval(model.parameters())
    mx.clear_cache()
    before = mx.get_active_memory()
    warm_up(model, vocab, compile_decode=compile_decode)  # compiled: its traces go with the batch
    gc.collect()
    # Nothing of the rows' KV or the batch stays (a few bytes of scalars may: MLX keeps constants).
    assert mx.get_active_memory() - before < 1024


@pytest.mark.parametrize("source", ["prompt-lookup", "draft"])
def test_a_speculating_warm_up_verifies_proposals_and_frees_its_arrays(source: str) -> None:
    from mlx_trio.engine.batch import decode_batch
    from mlx_trio.engine.speculative.speculator import SpeculationConfig

    model, vocab = _model("llama")
    mx.eval(model.parameters())
    speculation = (SpeculationConfig.prompt_lookup(3, 3) if source == "prompt-lookup"
                   else SpeculationConfig.draft(model, 3))
    proposed: list[int] = []
    step = decode_batch.DecodeBatch.step_speculative

    def counting(self: decode_batch.DecodeBatch) -> list[decode_batch.Decoded]:
        out = step(self)
        proposed.extend(sum(d.proposed) for d in out if d.proposed is not None)
        return out

    mx.clear_cache()
    before = mx.get_active_memory()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_batch.DecodeBatch, "step_speculative", counting)
        warm_up(model, vocab, speculation=speculation)
    gc.collect()
    assert sum(proposed) > 0  # the verify forwards (and rollbacks) ran, not plain steps only
    assert mx.get_active_memory() - before < 1024
