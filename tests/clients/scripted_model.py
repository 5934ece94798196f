"""A tiny Llama whose every reply is one fixed text, then EOS, whatever the prompt.

Agent CLIs treat a reply cut by max_tokens as an error (Claude Code: "response
exceeded the N output token maximum", Codex: "Incomplete response returned"),
and a random-weight model rarely samples EOS, so client tests need a model that
ends its turn. Making the reply independent of the prompt also lets a test
assert the exact text a client prints, although the clients' prompts (dates,
session ids, tool lists) change from run to run and version to version.

How: every attention and MLP output projection is zeroed, so the residual
stream at each position is just the current token's embedding and the next
token depends on the current token alone. The embeddings and the head then
spell a chain: any token outside the reply leads to the reply's first token,
each reply token to the next, the last to EOS. Logit gaps of `_GAP` make the
chain certain under any sampling temperature a client may send.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer

from mlx_trio.testing.tiny_models import EOS_TOKEN, TinyModelSpec, tiny_model

# Agent prompts run to tens of thousands of tokens (the tiny default of 4096 refuses them), and
# both clients send tools: the tool-calling template keeps the server from refusing those. The
# layers are silenced anyway, so one narrow layer keeps a CPU prefill of such prompts short.
SPEC = TinyModelSpec("llama", hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate=64,
                     max_position_embeddings=131072, tools=True)
# After the final RMSNorm a basis vector becomes sqrt(hidden) on its axis; the head
# row scale multiplies that, so the chosen token leads every other by ~sqrt(32) * 100.
_GAP = 100.0


def scripted_model(reply: str, out_dir: Path) -> Path:
    """Build (once per `out_dir`) the model whose every reply is `reply`; return its directory.

    `reply` must encode to distinct tokens (the chain is keyed by token) that
    are fewer than the hidden size; ValueError otherwise.
    """
    source = tiny_model(SPEC)
    tag = hashlib.sha256(reply.encode()).hexdigest()[:12]
    path = Path(out_dir) / f"scripted-{SPEC.cache_key()}-{tag}"
    if path.is_dir():
        return path
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    chain = tokenizer.encode(reply).ids
    if len(set(chain)) != len(chain) or len(chain) + 1 > SPEC.hidden_size:
        raise ValueError(f"{reply!r} encodes to {chain}: the reply needs distinct tokens, fewer than the hidden size")
    if tokenizer.decode(chain) != reply:
        raise ValueError(f"{reply!r} does not round-trip through the tiny tokenizer")
    shutil.copytree(source, path)
    weights = mx.load(str(source / "model.safetensors"))
    mx.save_safetensors(str(path / "model.safetensors"),
                        _chain_weights(weights, chain, tokenizer.token_to_id(EOS_TOKEN)),
                        metadata={"format": "mlx"})
    (path / "reply.json").write_text(json.dumps({"reply": reply, "tokens": chain}) + "\n", encoding="utf-8")
    return path


def _chain_weights(weights: dict[str, mx.array], chain: list[int], eos: int) -> dict[str, mx.array]:
    """`weights` with the layers silenced and the embeddings/head spelling `chain` then `eos`."""
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    other = len(chain)  # the embedding axis shared by every token outside the reply
    basis = mx.eye(hidden)
    embed = mx.broadcast_to(basis[other], (vocab, hidden))
    head = mx.zeros((vocab, hidden))
    rows = [(token, basis[axis]) for axis, token in enumerate(chain)]
    embed = _with_rows(embed, rows)
    # Current token on axis i -> the next token's head row is basis[i].
    heads = [(chain[0], basis[other])] + [(chain[i + 1], basis[i]) for i in range(len(chain) - 1)]
    head = _with_rows(head, [*heads, (eos, basis[len(chain) - 1])])
    out = dict(weights)
    out["model.embed_tokens.weight"] = embed
    out["lm_head.weight"] = head * _GAP
    out["model.norm.weight"] = mx.ones((hidden,))
    for name, value in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            out[name] = mx.zeros_like(value)
    return out


def _with_rows(matrix: mx.array, rows: list[tuple[int, mx.array]]) -> mx.array:
    """A copy of `matrix` with each (index, row) written in."""
    result = mx.array(matrix)
    for index, row in rows:
        result[index] = row
    return result
