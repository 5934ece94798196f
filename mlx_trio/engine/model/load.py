"""Load a model and its tokenizer with mlx-lm, and turn prompts into token ids.

`load_model` runs on the lease thread (it evaluates the weights, which is MLX
work). The returned `LoadedModel` is shared read-only afterwards: its weights
are evaluated arrays (usable from any thread), and its tokenizer methods are
plain Python that the Trio side may call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_lm_load

from mlx_trio.config import refused_message
from mlx_trio.errors import InvalidParameter, ModelLoadError
from mlx_trio.engine.attention import paged_layout, routed_attention
from mlx_trio.engine.distributed.world import current_world, shard_model
from mlx_trio.engine.model import fused_projections
from mlx_trio.engine.model.chat import check_chat, template_messages
from mlx_trio.engine.model.default_model import resolve_model_path
from mlx_trio.engine.model.generic_tools import generic_chat
from mlx_trio.engine.sampling.grammar import build_grammar_tokenizer, compile_constraint
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.kv.layout import KvLayout, check_quantized_attention, measure_layout, weights_bytes
from mlx_trio.engine.model.output_format import read_output_format
from mlx_trio.output_format import PLAIN, OutputFormat
from mlx_trio.params import Constraint

Message = Mapping[str, Any]

log = logging.getLogger(__name__)


@attrs.frozen
class LoadedModel:
    """A loaded model: weights, tokenizer and the facts requests are checked against."""

    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    model_id: str
    path: str
    vocab_size: int
    context_length: int | None
    eos_token_ids: frozenset[int]
    kv_layout: KvLayout
    weights_bytes: int
    # Reasoning and tool-call markers; PLAIN for models without any.
    output_format: OutputFormat = PLAIN
    # llguidance's tokenizer (built once: ~0.3 s for a 49k vocabulary); None if it cannot read ours.
    grammar_tokenizer: Any = None
    # How its rows store KV (--kv-bits ...); `kv_layout` counts bytes in this format.
    kv_scheme: KvScheme = KvScheme()
    # --draft-model: the draft for speculative decoding (engine/model/draft_model.py), or None.
    draft: nn.Module | None = None
    # Whether its decode steps compile their forward (engine/batch/compiled_step.py; --no-compile).
    compile_decode: bool | None = False
    # --kv-layout paged (or auto's choice of it): the model's block pool (engine/kv/blocks/paged_kv.py `PagedKV`),
    # made by `with_paged_kv`; else None (the padded layout).
    paged_kv: Any = None
    # Why `routed_attention.install` left the paged decode kernel off on a GPU (its self-check failed, a float32
    # model), if it did.
    paged_kernel_off_reason: str | None = None

    def check_constraint(self, constraint: Constraint) -> None:
        """Raise `InvalidParameter("constraint", ...)` unless this model can enforce `constraint`."""
        if self.grammar_tokenizer is None:
            raise InvalidParameter("constraint", f"model {self.model_id}'s tokenizer does not support constrained decoding")
        compile_constraint(constraint, self.grammar_tokenizer)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for (a part of a character for some byte-level tokens)."""
        if self.grammar_tokenizer is not None:
            return self.grammar_tokenizer.decode_bytes([token_id])
        return self.tokenizer.decode([token_id]).encode()

    def encode(self, prompt: str | Sequence[Message] | Sequence[int], *,
               chat_template_kwargs: Mapping[str, Any] | None = None,
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids for a raw string, a chat (list of messages) or given ids; raises `InvalidParameter` naming the field.

        A string is tokenized as mlx-lm's stream_generate does (special tokens
        added unless it already starts with BOS); messages go through the
        model's chat template with the generation prompt appended, and
        `tools` (OpenAI function tools) are given to the template as mlx_lm.server does,
        or, for a template without a tool format, written into the chat in the
        generic format (`engine/model/generic_tools.py`).
        """
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameter("prompt", "must not be empty")
            return self._encode_text(prompt)
        if not isinstance(prompt, Sequence):
            raise InvalidParameter("prompt", "must be a string, a list of messages or a list of token ids, "
                                             f"got {type(prompt).__name__}")
        items = list(prompt)
        if not items:
            raise InvalidParameter("prompt", "must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            bad = [t for t in items if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidParameter("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return items
        if all(isinstance(m, Mapping) for m in items):
            return self._encode_chat(items, dict(chat_template_kwargs or {}), tools)
        raise InvalidParameter("prompt", "must be a non-empty string, a list of chat messages or a list of token ids")

    def message_boundary(self, prompt: str | Sequence[Message] | Sequence[int], ids: Sequence[int], *,
                         chat_template_kwargs: Mapping[str, Any] | None = None,
                         tools: Sequence[Mapping[str, Any]] | None = None) -> int | None:
        """Where the chat's last message starts in `ids` (its encoding), or None for a non-chat or a single message.

        Found from the template itself: the chat without its last message,
        rendered without the generation prompt, shares this many leading
        tokens with the whole chat. The next turn of the conversation and
        sibling requests with the same history share that prefix, so the
        prompt cache snapshots it (docs/design.md §2.6).
        """
        if isinstance(prompt, str) or len(prompt) < 2 or not all(isinstance(m, Mapping) for m in prompt):
            return None
        try:
            head = self._apply_template(template_messages(prompt[:-1]), tools, add_generation_prompt=False,
                                        **dict(chat_template_kwargs or {}))
        except Exception:  # a template may refuse a chat ending on a non-user turn: no boundary then
            return None
        shared = 0
        for a, b in zip(head, ids):
            if a != b:
                break
            shared += 1
        return shared or None

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def detokenizer(self) -> Any:
        """A fresh streaming detokenizer for one request."""
        return self.tokenizer.detokenizer

    def _encode_text(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_token
        add_special = bos is None or not text.startswith(bos)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special))

    def _encode_chat(self, messages: list[Message], template_kwargs: dict[str, Any],
                     tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise InvalidParameter("messages", f"model {self.model_id} has no chat template; send a raw prompt instead")
        checked = check_chat(messages, template_args=template_kwargs, tools=tools, output_format=self.output_format,
                             model_id=self.model_id)
        try:
            ids = self._apply_template(checked, tools, add_generation_prompt=True, **template_kwargs)
        except Exception as exc:  # jinja raises arbitrary errors for bad chats
            raise InvalidParameter("messages", f"the chat template rejected these messages: {exc}") from exc
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise InvalidParameter("chat_template_kwargs", "the chat template did not produce token ids")
        return ids

    def _apply_template(self, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                        **kwargs: Any) -> Any:
        """The template applied to a chat, with its tools: the template's own format, or the generic one."""
        if not self.output_format.generic_tools:
            tool_kwargs = {"tools": [dict(t) for t in tools]} if tools else {}
            return self.tokenizer.apply_chat_template(messages, **tool_kwargs, **kwargs)
        try:
            return self.tokenizer.apply_chat_template(generic_chat(messages, tools), **kwargs)
        except Exception:
            if not tools:
                raise
            # Some templates refuse a system role: the tools go to the first user message instead.
            return self.tokenizer.apply_chat_template(generic_chat(messages, tools, system_role=False), **kwargs)


def load_model(model: str | None = None, *, cache_dir: Path | None = None,
               kv_scheme: KvScheme = KvScheme(), compile_decode: bool | None = False,
               fuse_projections: bool = True) -> LoadedModel:
    """Resolve (converting the default model once if needed) and load with mlx-lm.

    Must run on the lease thread: weights are evaluated there. One rank of a distributed group
    loads its tensor-parallel shard only (`engine/distributed/world.py`): lazily, sharded, then
    evaluated, so the other ranks' weights are never read here. Llama-family attention layers are
    then wrapped so that a padded batch's decode steps can take the ragged kernel on CUDA
    (engine/attention/routed_attention.py; `MLX_TRIO_NO_RAGGED_ATTENTION=1` leaves them as they are),
    and, with `fuse_projections` and outside a distributed group, each layer's q/k/v and gate/up
    projections become one matmul each (engine/model/fused_projections.py; pass False where adapters
    will wrap the projections; `MLX_TRIO_NO_FUSED_PROJECTIONS=1` fuses nothing).
    """
    path = resolve_model_path(model, cache_dir=cache_dir)
    world = current_world()
    try:
        loaded_model, tokenizer, config = mlx_lm_load(path, return_config=True, lazy=world.distributed)
        shard_model(loaded_model, world)
    except Exception as exc:
        raise ModelLoadError(f"could not load model {model or path!r}: {exc}") from exc
    mx.eval(loaded_model.parameters())
    installed = routed_attention.install(loaded_model)  # decode attention on the ragged and paged kernels (GPU)
    if fuse_projections and not world.distributed:  # shard() and pipeline() need the separate projections
        fused = fused_projections.fuse(loaded_model)
        log.info("fused projections: q/k/v in %d layers, gate/up in %d%s", fused.attention, fused.mlp,
                 f"; unfused: {'; '.join(fused.unfused)}" if fused.unfused else "")
    check_quantized_attention(loaded_model, kv_scheme)
    eos_token_ids = frozenset(tokenizer.eos_token_ids)
    return LoadedModel(
        model=loaded_model,
        tokenizer=tokenizer,
        model_id=_model_id(model, path),
        path=str(path),
        vocab_size=_vocab_size(loaded_model, config),
        context_length=_context_length(config),
        eos_token_ids=eos_token_ids,
        kv_layout=measure_layout(loaded_model, kv_scheme),
        weights_bytes=weights_bytes(loaded_model),
        output_format=read_output_format(tokenizer),
        grammar_tokenizer=build_grammar_tokenizer(tokenizer, eos_token_ids),
        kv_scheme=kv_scheme,
        compile_decode=compile_decode,
        paged_kernel_off_reason=installed.paged_off,
    )


def paged_refusals(model: LoadedModel) -> tuple[str, ...]:
    """Why `model` cannot hold paged KV here, one sentence each (empty: it can): a sliding-window layer, an
    attention the routed attention does not wrap (`paged_layout.refusal`), a distributed group. Lease thread."""
    reasons = [paged_layout.refusal(model.model)]
    if current_world().distributed:
        reasons.append("a distributed group's ranks would each need their own pool and tables (not built yet)")
    return tuple(f"model {model.model_id} cannot hold paged KV: {why}" for why in reasons if why is not None)


def paged_kernel_off(model: LoadedModel) -> str | None:
    """None when a paged decode kernel serves `model`'s decode steps (it passed its self-check at load) on a
    backend where it was measured at par with the padded step, else why not: the backend has none (the CPU), its
    self-check failed, or it was never measured (Metal: docs/design.md §6.5). Lease thread."""
    route = routed_attention.route_of(model.model)
    if route is not None and route.paged_decode is not None:
        if routed_attention.on_metal():
            # Correct (its self-check passed) but never timed on a Mac: `auto` keeps the measured layout there.
            return ("the Metal paged decode kernel passed its self-check but is not yet measured against the padded "
                    "step (--kv-layout paged uses it)")
        return None
    if model.paged_kernel_off_reason is not None:
        return f"the paged decode kernel is off: {model.paged_kernel_off_reason}"
    gpu = mx.default_device().type == mx.DeviceType.gpu
    backend = "metal" if routed_attention.on_metal() else "cuda" if gpu else "cpu"
    return f"no paged decode kernel on this backend ({backend})"


def with_paged_kv(model: LoadedModel, budget_bytes: int) -> LoadedModel:
    """`model` with a block pool of `budget_bytes` (the paged KV layout), allocated now; lease thread only.

    Raises ModelLoadError naming why the model cannot hold paged KV (`paged_refusals`; docs/design.md §6.5),
    so the server refuses at start.
    """
    refusals = paged_refusals(model)
    if refusals:
        raise ModelLoadError(refused_message(refusals))
    pool = paged_layout.paged_kv_for(model.model, budget_bytes, model.model_id)
    log.info("paged KV: %d blocks of %d tokens (%.1f MiB each), %.1f GiB", pool.storage.num_blocks, pool.block_size,
             pool.storage.bytes_per_block / 2**20, pool.storage.num_blocks * pool.storage.bytes_per_block / 2**30)
    return attrs.evolve(model, paged_kv=pool)


def _model_id(requested: str | None, path: str) -> str:
    if requested is None or requested == "default":
        return Path(path).name
    return requested


def _vocab_size(model: nn.Module, config: Mapping[str, Any]) -> int:
    text_config = config.get("text_config", config)
    size = text_config.get("vocab_size") or config.get("vocab_size")
    if size is None:
        raise ModelLoadError("model config has no vocab_size")
    return int(size)


def _context_length(config: Mapping[str, Any]) -> int | None:
    text_config = config.get("text_config", config)
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        if key in text_config:
            return int(text_config[key])
    return None

