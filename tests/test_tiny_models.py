"""The tiny random-weight models load through mlx-lm like real checkpoints and build deterministically."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlx_trio.testing import LLAMA, LLAMA_SWA, QWEN3, QWEN3_TOOLS, TinyModelSpec, build_tiny_model, tiny_model

PRESETS = {"llama": LLAMA, "qwen3": QWEN3, "llama_swa": LLAMA_SWA}
CHAT = [{"role": "user", "content": "Hello there, what is the capital of France?"}]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A private root, so these tests check builds of the current code, not a stale shared cache.
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module", params=list(PRESETS), ids=list(PRESETS))
def loaded(request: pytest.FixtureRequest, cache_root: Path) -> tuple[TinyModelSpec, Path, object, object]:
    spec = PRESETS[request.param]
    path = tiny_model(spec, cache_root)
    model, tokenizer = mlx_lm.load(str(path))
    return spec, path, model, tokenizer


def test_preset_loads_with_matching_vocab(loaded: tuple) -> None:
    """config.json's vocab_size equals the tokenizer's, and the head is untied."""
    _, path, model, tokenizer = loaded
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer.get_vocab()) == 512
    assert config["tie_word_embeddings"] is False
    assert model.lm_head.weight.shape == (512, 64)
    assert model.lm_head.weight.dtype == mx.float32


def test_preset_has_expected_cache_classes(loaded: tuple) -> None:
    """Full-attention layers get KVCache; LLAMA_SWA's sliding layers get a RotatingKVCache of the window."""
    spec, _, model, _ = loaded
    caches = make_prompt_cache(model)
    assert len(caches) == spec.num_layers
    if spec.sliding_window is None:
        assert all(type(c) is KVCache for c in caches)
    else:
        assert [type(c) for c in caches] == [RotatingKVCache, KVCache]
        assert caches[0].max_size == spec.sliding_window


def test_chat_template_is_chatml(loaded: tuple) -> None:
    """The ChatML template renders with the generation prompt, and <|im_end|> is the single EOS token."""
    _, _, _, tokenizer = loaded
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\nHello there, what is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == im_start and ids.count(im_end) == 1
    assert tokenizer.eos_token_ids == {im_end}


def test_tokenizer_round_trips_arbitrary_text(loaded: tuple) -> None:
    """Byte-level BPE: text outside the training corpus (unicode, digits, spacing) decodes back exactly."""
    _, _, _, tokenizer = loaded
    text = "Zürich 12345 — naïve  café\t🙂 it's fine."
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_greedy_generation_varies(loaded: tuple) -> None:
    """Greedy decoding from a chat prompt yields at least 3 distinct tokens over 30 steps."""
    _, _, model, tokenizer = loaded
    prompt = mx.array(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    tokens = [token for (token, _), _ in zip(generate_step(prompt, model), range(30))]
    assert len(set(tokens)) >= 3


def test_sliding_window_model_generates_past_its_window(cache_root: Path) -> None:
    """LLAMA_SWA decodes a prompt longer than its window, so tests using it do cross the window."""
    model, tokenizer = mlx_lm.load(str(tiny_model(LLAMA_SWA, cache_root)))
    prompt = tokenizer.encode("Once upon a time there was a little robot who lived in a lighthouse by the sea.")
    assert len(prompt) > LLAMA_SWA.sliding_window
    tokens = [token for (token, _), _ in zip(generate_step(mx.array(prompt), model), range(8))]
    assert len(tokens) == 8


@pytest.mark.parametrize("spec", [LLAMA, QWEN3, QWEN3_TOOLS], ids=["llama", "qwen3", "qwen3_tools"])
def test_build_is_byte_identical(spec: TinyModelSpec, tmp_path: Path) -> None:
    """Two builds of one spec in fresh directories write the same bytes."""
    first, second = build_tiny_model(spec, tmp_path / "a"), build_tiny_model(spec, tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    """The seed actually reaches the weights."""
    a = build_tiny_model(LLAMA, tmp_path / "a")
    b = build_tiny_model(TinyModelSpec("llama", seed=1), tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_weights_do_not_depend_on_global_rng(tmp_path: Path) -> None:
    """Weights come from the spec's seed alone, whatever state the global RNG is in."""
    mx.random.seed(1)
    a = build_tiny_model(QWEN3, tmp_path / "a")
    mx.random.seed(2)
    mx.random.uniform(shape=(3,))
    b = build_tiny_model(QWEN3, tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_tiny_model_caches_by_spec(tmp_path: Path) -> None:
    """tiny_model builds once per spec: a second call returns the same directory untouched."""
    path = tiny_model(LLAMA, tmp_path)
    mtime_ns = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_model(LLAMA, tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime_ns
    assert tiny_model(LLAMA_SWA, tmp_path) != path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LLAMA.cache_key(), LLAMA_SWA.cache_key()])


def test_spec_rejects_unknown_arch_and_qwen3_window() -> None:
    """Specs the builder cannot honour fail at construction, not at load time."""
    with pytest.raises(ValueError, match="arch"):
        TinyModelSpec("mistral")
    with pytest.raises(ValueError, match="sliding_window"):
        TinyModelSpec("qwen3", sliding_window=8)


def test_tools_field_leaves_the_older_specs_keys_alone() -> None:
    """The `tools` field enters the cache key only when set, so existing builds (and goldens) keep their keys."""
    assert LLAMA.cache_key() == "llama-4bfea29d3029bf0c" and QWEN3.cache_key() == "qwen3-2f09bbffe168def1"
    assert QWEN3_TOOLS.cache_key() != QWEN3.cache_key()


def test_tools_model_has_single_marker_tokens_and_renders_tool_turns(cache_root: Path) -> None:
    """QWEN3_TOOLS: <think>/<tool_call> markers are single tokens; the template renders tools, calls and results."""
    _, tokenizer = mlx_lm.load(str(tiny_model(QWEN3_TOOLS, cache_root)))
    for marker in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    text = tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith('<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n\n<tool_call>\n'
                         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
                         '<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n'
                         '<|im_start|>assistant\n')
