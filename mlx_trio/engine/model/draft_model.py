"""Load a draft model for speculative decoding (`--draft-model`) and check it can draft for the target.

A draft proposes token ids that the target verifies, so both must mean the
same thing by every id: the draft's tokenizer vocabulary must equal the
target's (mlx_lm.server assumes it silently; here a mismatch is a
`ModelLoadError` at start). Its layers must all be full-attention KV
caches, whose rows can drop a rejected tail (engine/kv/row_rollback.py).
Runs on the lease thread (it evaluates the weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.kv.layout import measure_layout, weights_bytes
from mlx_trio.engine.kv.row_rollback import supports_rollback
from mlx_trio.engine.model.default_model import resolve_model_path
from mlx_trio.engine.model.load import LoadedModel
from mlx_trio.errors import ModelLoadError


def with_draft_model(target: LoadedModel, path: str, *, cache_dir: Path | None = None) -> LoadedModel:
    """`target` with the draft at `path` loaded (`load_draft_model`) and counted.

    Admission's projections then include the draft's KV: a row's bytes per
    token are the target's plus the draft's (every row has a draft row), and
    `weights_bytes` includes the draft's weights, so the default KV budget
    (device memory less weights) leaves room for them.
    """
    draft = load_draft_model(path, target.tokenizer, cache_dir=cache_dir)
    layout = target.kv_layout
    return attrs.evolve(target, draft=draft, weights_bytes=target.weights_bytes + weights_bytes(draft),
                        kv_layout=attrs.evolve(layout, full_bytes_per_token=layout.full_bytes_per_token
                                               + measure_layout(draft).full_bytes_per_token))


def load_draft_model(path: str, target_tokenizer: Any, *, cache_dir: Path | None = None) -> nn.Module:
    """The draft model at `path`, evaluated; `ModelLoadError` if it cannot draft for the target."""
    try:
        model, tokenizer = mlx_lm_load(resolve_model_path(path, cache_dir=cache_dir))
    except Exception as exc:
        raise ModelLoadError(f"could not load the draft model {path!r}: {exc}") from exc
    if _vocabulary(tokenizer) != _vocabulary(target_tokenizer):
        raise ModelLoadError(f"the draft model {path!r} has another tokenizer than the model: a draft must "
                             "share the model's vocabulary (token ids) exactly")
    if not supports_rollback(make_prompt_cache(model)):
        raise ModelLoadError(f"the draft model {path!r} has sliding-window or recurrent layers: it cannot draft "
                             "(its KV cannot drop rejected tokens)")
    mx.eval(model.parameters())
    return model


def _vocabulary(tokenizer: Any) -> dict[str, int]:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return dict(hf.get_vocab())
