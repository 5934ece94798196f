"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

Only mlx and `tokenizers` are needed: `mx.load` reads the
GGUF (Q4_0/Q4_1/Q8_0 tensors come back as MLX affine-quantized triplets with
group size 32), and the tokenizer is rebuilt from the GGUF metadata. The output
is a plain mlx-lm checkpoint that `mlx_lm.load(out_dir)` accepts.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from mlx_trio.errors import ModelLoadError

# Bump whenever the output of `convert_gguf` changes, so cached conversions
# (see default_model.py) are redone.
CONVERTER_VERSION = 1

# "q4f32" and "q4" keep the GGUF's quantized weights; the float ones dequantize.
DTYPES = ("q4f32", "q4", "f32", "bf16", "f16")

# GGUF's Q4_0/Q4_1/Q8_0 blocks are 32 values wide, and mx.load keeps that grouping.
GROUP_SIZE = 32

_FLOAT_DTYPES = {"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# tokenizer.ggml.token_type value for control tokens (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL).
_TOKEN_TYPE_CONTROL = 3


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dtype: str = "q4f32",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write an mlx-lm model directory for the llama GGUF at `gguf_path`; return `out_dir`.

    `dtype`: "q4f32" keeps the quantized weights with float32 scales, biases and
    norms (MLX's CPU backend runs float16 activations ~40x slower); "q4" keeps
    float16 scales (the usual MLX layout, for GPUs); "f32", "bf16", "f16"
    dequantize everything. The directory is assembled next to `out_dir` and
    renamed into place at the end, so an interrupted conversion leaves no half
    directory. Raises `FileExistsError` if `out_dir` exists and `ModelLoadError`
    for a file that is not a supported llama GGUF.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    report = progress or (lambda _msg: None)
    label = f"converting {gguf_path.name} → mlx {dtype}"
    started_s = time.monotonic()

    weights, metadata = _read_gguf(gguf_path)
    config = _model_config(metadata, has_output="output.weight" in weights)
    converted, quantization = _convert_weights(weights, config, dtype, lambda m: report(f"{label} {m}"))
    if quantization is not None:
        # mlx-lm's own save_config writes the block under both keys; do the same.
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    tokenizer = _build_tokenizer(metadata)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp_dir.chmod(0o755)  # mkdtemp makes it 0o700; the result is an ordinary directory
        report(f"{label} (writing)")
        mx.save_safetensors(str(tmp_dir / "model.safetensors"), converted, metadata={"format": "mlx"})
        _write_json(tmp_dir / "config.json", config)
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        for name, content in _tokenizer_files(metadata, config).items():
            _write_json(tmp_dir / name, content)
        os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    report(f"{label} done in {time.monotonic() - started_s:.1f} s")
    return out_dir


def unpermute_rope_rows(rows: mx.array, num_heads: int) -> mx.array:
    """Undo llama.cpp's rope row permutation of a Q or K projection (rows = output features).

    llama.cpp's HF→GGUF converter reorders each head's rows from the HF halves
    layout [0..d/2) [d/2..d) to interleaved pairs (0, d/2, 1, d/2+1, ...) for
    its "normal" rope; mlx-lm uses the HF layout. Works on a quantized weight,
    its scales and its biases alike: quantization groups run along columns, so
    whole rows move together.
    """
    out_features = rows.shape[0]
    half = out_features // num_heads // 2
    return (
        rows.reshape(num_heads, half, 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _read_gguf(gguf_path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    try:
        weights, metadata = mx.load(str(gguf_path), return_metadata=True)
    except Exception as exc:  # mx.load raises plain RuntimeError/ValueError
        raise ModelLoadError(f"cannot read GGUF {gguf_path}: {exc}") from exc
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ModelLoadError(f"{gguf_path}: only llama-architecture GGUF is supported, got {architecture!r}")
    return weights, metadata


def _scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return value.item() if isinstance(value, mx.array) else value


def _float32_value(value: float) -> float:
    # GGUF stores these as float32; 1e-5 would otherwise read back as 9.999999747378752e-06.
    return float(f"{value:.7g}")


def _model_config(metadata: dict[str, Any], *, has_output: bool) -> dict[str, Any]:
    rope_scaling = metadata.get("llama.rope.scaling.type", "none")
    if rope_scaling != "none":
        raise ModelLoadError(f"GGUF rope scaling {rope_scaling!r} is not supported")
    heads = _scalar(metadata, "llama.attention.head_count")
    hidden = _scalar(metadata, "llama.embedding_length")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _scalar(metadata, "llama.block_count"),
        "intermediate_size": _scalar(metadata, "llama.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(metadata, "llama.attention.head_count_kv", heads),
        "head_dim": _scalar(metadata, "llama.attention.key_length", hidden // heads),
        "rms_norm_eps": _float32_value(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(_scalar(metadata, "llama.rope.freq_base", 10000.0)),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": _scalar(metadata, "llama.context_length"),
        "tie_word_embeddings": not has_output,
        **{
            f"{kind}_token_id": int(token_id.item())
            for kind in ("bos", "eos")
            if (token_id := metadata.get(f"tokenizer.ggml.{kind}_token_id")) is not None
        },
    }


def _hf_name(gguf_name: str) -> str:
    module, _, param = gguf_name.rpartition(".")
    _, layer, kind = module.split(".", 2) if module.startswith("blk.") else ("", "", module)
    # An unknown tensor (e.g. llama3's rope_freqs) changes the maths; refuse rather than drop it.
    if layer and kind in _LAYER_NAMES:
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{param}"
    if not layer and kind in _TOP_NAMES:
        return f"{_TOP_NAMES[kind]}.{param}"
    raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r}")


def _convert_weights(
    weights: dict[str, mx.array],
    config: dict[str, Any],
    dtype: str,
    report: Callable[[str], None],
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename, un-permute and cast every tensor; return the weights and the quantization block."""
    keep_quantized = dtype in ("q4f32", "q4")
    float_dtype = mx.float16 if dtype == "q4" else _FLOAT_DTYPES.get(dtype, mx.float32)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    modules = sorted({name.rpartition(".")[0] for name in weights})
    bits_by_module: dict[str, int] = {}
    out: dict[str, mx.array] = {}
    for i, module in enumerate(modules, start=1):
        kind = module.rpartition(".")[2]
        params = {p: weights[f"{module}.{p}"] for p in ("weight", "scales", "biases") if f"{module}.{p}" in weights}
        if kind in heads:
            params = {p: unpermute_rope_rows(v, heads[kind]) for p, v in params.items()}
        name = _hf_name(f"{module}.weight").rpartition(".")[0]
        num_done = len(out)
        if "scales" in params:
            # Group size is fixed at 32, so the packed-column ratio gives the bit width.
            bits = params["weight"].shape[-1] // params["scales"].shape[-1]
            scales, biases = params["scales"].astype(mx.float32), params["biases"].astype(mx.float32)
            if keep_quantized:
                bits_by_module[name] = bits
                out[f"{name}.weight"] = params["weight"]
                out[f"{name}.scales"] = scales.astype(float_dtype)
                out[f"{name}.biases"] = biases.astype(float_dtype)
            else:
                # Dequantize in float32 first so bf16/f16 outputs round only once.
                full = mx.dequantize(params["weight"], scales, biases, group_size=GROUP_SIZE, bits=bits)
                out[f"{name}.weight"] = full.astype(float_dtype)
        else:
            out[f"{name}.weight"] = params["weight"].astype(float_dtype)
        mx.eval(*list(out.values())[num_done:])  # per module, so progress reports track real work
        if i == len(modules) or i % max(1, len(modules) // 4) == 0:
            report(f"(tensors {i}/{len(modules)})")
    return out, _quantization_block(bits_by_module)


def _quantization_block(bits_by_module: dict[str, int]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` config: the common bit width, plus per-module overrides keyed by path."""
    if not bits_by_module:
        return None
    common_bits = collections.Counter(bits_by_module.values()).most_common(1)[0][0]
    block: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common_bits, "mode": "affine"}
    for name, bits in sorted(bits_by_module.items()):
        if bits != common_bits:
            block[name] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    return block


def _build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """Rebuild the HF byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
    kind, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre_tokenizer_by_name = {
        # SmolLM2/Cosmo: GPT-2's regex, but every digit is its own pre-token.
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
        "gpt2": byte_level,
        "default": byte_level,
    }
    if kind != "gpt2" or pre not in pre_tokenizer_by_name:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model={kind!r} pre={pre!r}; "
            f"supported: model 'gpt2' with pre in {sorted(pre_tokenizer_by_name)}"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizer_by_name[pre]
    tokenizer.decoder = decoders.ByteLevel()
    token_types = _token_types(metadata, len(tokens))
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == _TOKEN_TYPE_CONTROL
        ]
    )
    return tokenizer


def _token_types(metadata: dict[str, Any], num_tokens: int) -> list[int]:
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is None:
        return [1] * num_tokens
    return token_types.tolist() if isinstance(token_types, mx.array) else list(token_types)


def _tokenizer_files(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json contents."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[int(token_id.item())]

    special = {f"{key}_token": token(key) for key in ("bos", "eos", "pad", "unk")}
    special = {key: value for key, value in special.items() if value is not None}
    tokenizer_config: dict[str, Any] = {
        **special,
        # Chat templates already spell out every special token; a BOS on top would double it.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "tokenizer.chat_template" in metadata:
        tokenizer_config["chat_template"] = metadata["tokenizer.chat_template"]
    generation_config = {
        key: config[key] for key in ("bos_token_id", "eos_token_id") if config.get(key) is not None
    }
    if (pad_id := metadata.get("tokenizer.ggml.padding_token_id")) is not None:
        generation_config["pad_token_id"] = int(pad_id.item())
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
        "generation_config.json": generation_config,
    }


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
