"""The benchmarks' model choice: a copy of the model that declares no EOS token, weights shared."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_trio.testing.shaped_models import no_eos_copy, resolve_model
from mlx_trio.testing.tiny_models import LLAMA, tiny_model


def _json(path: Path) -> dict[str, object]:
    return json.loads(path.read_text())


def test_the_tiny_shape_is_the_tiny_llama_without_eos(tmp_path: Path) -> None:
    src = tiny_model(LLAMA)
    assert _json(src / "tokenizer_config.json")["eos_token"]  # the original declares one: the copy must drop it
    model_dir, label = resolve_model(tmp_path, shape="tiny", model=None, num_layers=None)
    assert model_dir == tmp_path / "model" and label.startswith("tiny llama")
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(p.name for p in src.iterdir())
    assert (model_dir / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    assert "eos_token_id" not in _json(model_dir / "config.json")
    assert "eos_token_id" not in _json(model_dir / "generation_config.json")
    assert _json(model_dir / "tokenizer_config.json")["eos_token"] is None
    assert "eos_token" not in _json(model_dir / "special_tokens_map.json")


def test_no_eos_copy_clears_a_nested_text_config(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"eos_token_id": [1, 2], "text_config": {"eos_token_id": 2,
                                                                                         "hidden_size": 8}}))
    (src / ".hidden").write_text("skipped")
    copy = no_eos_copy(src, tmp_path / "copy")
    assert _json(copy / "config.json") == {"text_config": {"hidden_size": 8}}
    assert not (copy / ".hidden").exists()
