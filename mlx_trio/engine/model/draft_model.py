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

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.kv.row_rollback import supports_rollback
from mlx_trio.engine.model.default_model import resolve_model_path
from mlx_trio.errors import ModelLoadError


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
