"""Deterministic tiny random-weight models, written as real mlx-lm model directories.

Tests need models that load through `mlx_lm.load` exactly like a real one
(config, safetensors, HF tokenizer, chat template) yet build in about a second
on a 2-core CPU. The weights are random but seeded; the tokenizer is a real
byte-level BPE trained on the small corpus below, so text round-trips and the
chat template tokenizes like ChatML models do. Building the same spec twice
gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Part of the cache key: bump when the files a spec produces change.
BUILD_VERSION = 1

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# For `TinyModelSpec(tools=True)`: single tokens that make mlx-lm's TokenizerWrapper see a
# thinking model (`<think>`) and, with the template below, a Hermes/Qwen tool caller.
TOOL_SPECIAL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen3's template cut down to what tests need: tools in the system turn, assistant
# `tool_calls` as `<tool_call>` JSON, `tool` results grouped in a user turn, and
# `enable_thinking=False` closing an empty think span. mlx-lm infers the `json_tools`
# parser from it (it names `<tool_call>` and `tool_call.name`).
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still be a useful
test subject when its weights are random, as long as it is deterministic and fast.
Serving engines batch many requests together, stream tokens back to their clients,
and must never lose a token when something fails in the middle of a step.

Once upon a time there was a little robot who lived in a lighthouse by the sea.
Every evening it climbed the stairs, counted the ships, and wrote their names in a
book. The waves were loud, the wind was cold, and the light turned round and round.

What is the capital of France? The capital of France is Paris. What is the capital
of Italy? The capital of Italy is Rome. Numbers such as 1, 2, 3, 42 and 2024 appear
in text too, and so do questions, answers, commas, quotes and "double quotes".

def add(a, b):
    return a + b

Hello world! How can I help you today? Please write a short poem about the sea,
then explain in one sentence why the sky is blue and why the grass is green.
"""


@attrs.frozen
class TinyModelSpec:
    """What to build; every field goes into the cache key."""

    arch: str  # "llama" or "qwen3": the mlx_lm.models module name
    # Llama only: alternate sliding/full attention layers with this window, so
    # mlx-lm's make_cache gives the sliding layers a RotatingKVCache.
    sliding_window: int | None = None
    hidden_size: int = 64
    num_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    seed: int = 0
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    # Random logits are nearly flat; scaling the untied head makes the next-token
    # distribution peaked enough that greedy output varies and top-k/top-p bite.
    lm_head_scale: float = 8.0
    # Gain on every attention/MLP projection. At mlx.nn's default init the
    # residual stream is mostly the current token's embedding, so greedy decoding
    # falls into 2-token loops; a gain of ~3 lets the context steer the output.
    layer_scale: float = 3.0
    # Thinking and tool-call tokens plus QWEN_TOOLS_TEMPLATE instead of plain ChatML.
    tools: bool = False

    def __attrs_post_init__(self) -> None:
        if self.arch not in ("llama", "qwen3", "qwen2"):  # qwen2: a model type with pipeline() in mlx-lm
            raise ValueError(f"arch must be 'llama', 'qwen3' or 'qwen2', got {self.arch!r}")
        if self.sliding_window is not None and self.arch != "llama":
            raise ValueError("sliding_window is only supported for arch='llama'")

    def cache_key(self) -> str:
        fields_dict = attrs.asdict(self)
        if not self.tools:
            del fields_dict["tools"]  # keeps the keys of specs that predate the field
        fields = json.dumps({**fields_dict, "build_version": BUILD_VERSION}, sort_keys=True)
        return f"{self.arch}-{hashlib.sha256(fields.encode()).hexdigest()[:16]}"


LLAMA = TinyModelSpec("llama")
QWEN3 = TinyModelSpec("qwen3")
LLAMA_SWA = TinyModelSpec("llama", sliding_window=16)
QWEN3_TOOLS = TinyModelSpec("qwen3", tools=True)


def build_tiny_model(spec: TinyModelSpec, out_dir: Path) -> Path:
    """Write an mlx-lm model directory for `spec` into `out_dir` (created if needed); return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, extra_special_tokens=TOOL_SPECIAL_TOKENS if spec.tools else ())
    config = model_config(spec, vocab_size=tokenizer.get_vocab_size())
    mx.save_safetensors(str(out_dir / "model.safetensors"), _random_weights(spec, config), metadata={"format": "mlx"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    files: dict[str, dict[str, Any]] = {
        "config.json": config,
        "tokenizer_config.json": {
            "bos_token": None,
            "eos_token": EOS_TOKEN,
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": QWEN_TOOLS_TEMPLATE if spec.tools else CHATML_TEMPLATE,
        },
        "special_tokens_map.json": {"eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>"},
        "generation_config.json": {"eos_token_id": eos_id},
    }
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir


def tiny_model(spec: TinyModelSpec, cache_root: Path | None = None) -> Path:
    """Path of a built model for `spec`, building it once per cache root (safe across processes).

    Default root: `<tempdir>/mlx-trio-tiny-models`. A build goes to a private
    directory that is renamed into place, so a directory that exists is complete.
    """
    root = Path(cache_root) if cache_root is not None else Path(tempfile.gettempdir()) / "mlx-trio-tiny-models"
    return built_once(root / spec.cache_key(), lambda out: build_tiny_model(spec, out))


def built_once(path: Path, build: Callable[[Path], Any]) -> Path:
    """`path`, made by `build(directory)` unless it exists; safe across processes.

    The build goes to a private directory that is renamed into place, so a
    directory that exists is complete.
    """
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        build(tmp_dir)
        tmp_dir.chmod(0o755)
        os.rename(tmp_dir, path)
    except OSError:
        if not path.is_dir():
            raise
        # Another process won the race with an identical build; keep theirs.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def train_tokenizer(vocab_size: int, *, extra_special_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE over the embedded corpus; ids 0-2 are the special tokens, then any extra ones."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        # Every byte gets a token, so any text encodes even if the corpus lacks it.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def model_config(spec: TinyModelSpec, *, vocab_size: int) -> dict[str, Any]:
    """The config.json mlx-lm builds the model from (vocab_size must match the tokenizer)."""
    config: dict[str, Any] = {
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden_size // spec.heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,  # a tied random head mostly repeats the last token
    }
    if spec.sliding_window is not None:
        config["sliding_window"] = spec.sliding_window
        config["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)
        ]
    return config


def _random_weights(spec: TinyModelSpec, config: dict[str, Any]) -> dict[str, mx.array]:
    """Seeded float32 weights with mlx.nn's default init scales, drawn from explicit keys.

    Explicit keys rather than mx.random.seed: the weights depend on the spec
    alone, and a build never reseeds the global RNG that sampling tests seed
    themselves (instantiating the model below only advances it).
    """
    arch = importlib.import_module(f"mlx_lm.models.{spec.arch}")
    # The model is only instantiated for its parameter names and shapes.
    shapes = {name: p.shape for name, p in tree_flatten(arch.Model(arch.ModelArgs.from_dict(config)).parameters())}
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    weights: dict[str, mx.array] = {}
    for name, key in zip(names, keys):
        shape = shapes[name]
        if "norm" in name:
            weights[name] = mx.ones(shape, dtype=mx.float32)
        elif "embed_tokens" in name:
            weights[name] = mx.random.normal(shape, key=key) * math.sqrt(1 / shape[-1])
        else:
            gain = spec.lm_head_scale if name.startswith("lm_head") else spec.layer_scale
            bound = math.sqrt(1 / shape[-1])
            weights[name] = mx.random.uniform(-bound, bound, shape, key=key) * gain
    mx.eval(weights)
    return weights
