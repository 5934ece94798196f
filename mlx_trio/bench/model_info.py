"""EOS token ids of a local model directory, read from its JSON files (no tokenizer library).

The bench suppresses EOS with `logit_bias {eos: -100}` so every request
generates exactly `max_tokens` tokens on both servers. mlx-lm stops on the
union of `generation_config.json`'s and `config.json`'s `eos_token_id` and the
tokenizer's `eos_token`, so all of those are collected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Our server caps logit_bias values at ±100 (as OpenAI does); -100 makes a token all but impossible.
EOS_BIAS = -100.0


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _token_id(model_dir: Path, token: str) -> int | None:
    """The id of `token` in tokenizer.json: its added tokens first, then the model vocabulary."""
    tokenizer = _read_json(model_dir / "tokenizer.json")
    for added in tokenizer.get("added_tokens") or ():
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return added["id"]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
        return vocab[token]
    return None


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Every EOS id the model directory declares, sorted; () if it is not a readable directory."""
    path = Path(model_dir)
    if not path.is_dir():
        return ()
    ids = _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
    ids |= _ids(_read_json(path / "config.json").get("eos_token_id"))
    eos = _read_json(path / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):  # {"content": "<|im_end|>", ...} in older tokenizer configs
        eos = eos.get("content")
    if isinstance(eos, str) and (token_id := _token_id(path, eos)) is not None:
        ids.add(token_id)
    return tuple(sorted(ids))


def eos_logit_bias(eos_ids: tuple[int, ...]) -> dict[int, float]:
    """The `logit_bias` that suppresses every id in `eos_ids`."""
    return {token_id: EOS_BIAS for token_id in eos_ids}
