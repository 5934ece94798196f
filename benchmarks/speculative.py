"""Speculative decoding in the batch lane (issue 23): tok/s and acceptance against plain decoding at B=1/4/16.

Usage:
    PYTHONPATH=$PWD python benchmarks/speculative.py --tiny                  # CPU shape check, < 1 min
    python benchmarks/speculative.py --model /tmp/mlx-trio-gpu-models/llama-1b --batches 1,4,16 --json out.json

Workload, "edit this file": each row's prompt is a ~`--file-tokens` file
(seeded token ids) followed by an instruction, and the answer is decoded
greedily for `--tokens` tokens. The engine's `DecodeBatch` runs directly
(rows prefilled alone, all joined, then stepped: no actors or HTTP), once
per proposal source, on the same rows:

* ``plain``      no speculation (the baseline; its tokens are the oracle's truth);
* ``lookup``     ``--prompt-lookup`` (n-gram lookup over prompt + output, K=``--k``);
* ``echo``       proposals are the true continuation: every proposal accepted,
                 K+1 tokens per forward (the ceiling: a model echoing the file);
* ``edit``       the true continuation with a wrong token at one position in ``--edit-every``
                 (seeded; an echo with small edits: a rejection at each edit);
* ``reject``     every proposal wrong: the cost of verifying K tokens for nothing (the floor);
* ``draft-self``  ``--draft-model`` = the model itself: every greedy proposal accepted, at the
                 price of K draft forwards of the full model per step (the acceptance ceiling of
                 a draft, not a speed one);
* ``draft``      ``--draft-model`` = ``--draft PATH`` when given (a smaller same-tokenizer model);
* at B=1 also ``mlx_lm spec``: mlx-lm's ``speculative_generate_step`` with the same-model draft,
                 and ``mlx_lm plain``: its ``generate_step`` (the same tokens, checked).

What random weights can and cannot show: a random model does not echo its
prompt, so ``lookup``'s acceptance here is whatever the model's own greedy
loops give, not what a real model gives on a real edit; it measures the
cost of lookup and verification honestly, not the benefit. ``echo`` /
``edit`` / ``reject`` fix the acceptance by construction (proposals from
the plain run), so they show what a step of verified K+1 tokens costs at
each acceptance rate on this device and shape: the speed-up an echoing
model would get, given its acceptance. Every source's tokens are checked
against ``plain`` (greedy speculation must not change a token).

tok/s counts `--tokens` per row over the decode window (after every row
joined, until every row has its tokens). Steps are model forwards.

Attention runs as the engine runs it (`prepare_thread`: on CUDA MLX's own
kernels unless MLX_TRIO_ATTENTION_BACKEND / MLX_CUDA_USE_CUDNN_SDPA say
otherwise). Before this, the script ran MLX's default (cuDNN on CUDA), where
every verify forward, a few queries at a new key length, builds a new cuDNN
plan: the ~50 ms speculative steps of the tenth H200 pass. Each source first
runs 16 tokens on the same rows (kernels compiled, as the server's warm-up
compiles them), then the timed run.

``--phases`` adds, per source, where a step's time goes: each piece of the
speculative step (the target's forward, the sampler's calls, the proposer,
the rollback) is evaluated and timed on its own. The forced evaluations
serialise what the real step overlaps, so the pieces add up to more than
the step; they say which piece is large, not the step's speed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm import load

from mlx_trio.engine.batch import decode_batch as decode_batch_module
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.lease_thread import chosen_backend, prepare_thread
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.params import SamplingParams


class _Scripted:
    """Proposes the row's true continuation (from the plain run), with a wrong token where `wrong(i)` says."""

    def __init__(self, truth: list[int], prompt_length: int, tokens: Sequence[int], wrong: Any, vocab: int) -> None:
        self._truth, self._prompt_length, self._count, self._wrong = truth, prompt_length, len(tokens), wrong
        self._vocab = vocab  # a wrong token is still a token: an id past the embedding reads garbage

    def extend(self, tokens: Sequence[int]) -> None:
        self._count += len(tokens)

    def propose(self, k: int) -> list[int]:
        start = self._count - self._prompt_length
        out = []
        for i in range(start, min(start + k, len(self._truth))):
            out.append((self._truth[i] + 1) % self._vocab if self._wrong(i) else self._truth[i])
        return out


def _prompts(batch: int, file_tokens: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    instruction = [rng.randrange(3, vocab) for _ in range(16)]
    return [[rng.randrange(3, vocab) for _ in range(file_tokens)] + instruction for _ in range(batch)]


class _Phases:
    """Seconds per piece of the speculative step: each wrapped call is evaluated and timed alone."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn: Any, evaluate: Any = None) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(_arrays(out if evaluate is None else evaluate(args)))
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1
            return out
        return timed

    def instrument(self, batch: DecodeBatch) -> None:
        """Time the batch's pieces (instance attributes of this one batch; the module's rollback function)."""
        batch._model = self.wrap("target forward", batch._model)
        sampler = batch._sampler
        for name in ("sample", "masks_along", "allowed_proposals", "checkpoint", "rewind", "accept_runs", "accept"):
            setattr(sampler, name, self.wrap(f"sampler.{name}", getattr(sampler, name)))
        if batch._speculator is not None:
            for name in ("proposals", "extend"):
                setattr(batch._speculator, name, self.wrap(f"proposer.{name}", getattr(batch._speculator, name)))
        step = batch.step_speculative
        batch.step_speculative = self.wrap("whole step (timed pieces inside)", step)

    def report(self, steps: int) -> dict[str, float]:
        return {name: 1000 * sec / max(1, steps) for name, sec in sorted(self.seconds.items(), key=lambda kv: -kv[1])}


def _arrays(out: Any) -> list[mx.array]:
    """The arrays in `out` (nested lists / tuples), for `mx.eval`."""
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (list, tuple)):
        return [a for item in out for a in _arrays(item)]
    return []


class _TimedRollback:
    """`row_rollback` as decode_batch sees it, with `roll_back_rows` evaluated and timed (``--phases``)."""

    def __init__(self, module: Any, phases: _Phases) -> None:
        self._module = module
        self.roll_back_rows = phases.wrap("rollback", module.roll_back_rows,
                                          evaluate=lambda args: [c.state for c in args[0]])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _run(model: Any, prompts: list[list[int]], tokens: int, speculation: SpeculationConfig | None,
         prefill_step_size: int, phases: _Phases | None = None) -> dict[str, Any]:
    params = SamplingParams(max_tokens=tokens + 64)
    batch = DecodeBatch(model, speculation=speculation)
    out: list[list[int]] = []
    for i, ids in enumerate(prompts):
        row = SoloRow(model, f"r{i}", ids, params, prefill_step_size=prefill_step_size)
        while row.prefill_remaining:
            row.prefill_chunk()
        out.append([row.first_token()])
        batch.join_many([(row, out[-1][0])])
    steps = proposed = accepted = 0
    if phases is not None and speculation is not None:
        phases.instrument(batch)
    start = time.perf_counter()
    while min(len(t) for t in out) < tokens:
        for decoded in batch.steps_decoded(1):
            if decoded is None:
                continue
            steps += decoded.forwards
            proposed += sum(decoded.proposed)
            accepted += sum(decoded.accepted)
            for row_tokens, token in zip(out, decoded.token_ids):
                if token is not None:
                    row_tokens.append(token)
    decoded = batch.flush_decoded()
    if decoded is not None:
        for row_tokens, token in zip(out, decoded.token_ids):
            row_tokens.append(token)
    elapsed = time.perf_counter() - start
    batch.close()
    mx.clear_cache()
    return {"tok_s": len(prompts) * (tokens - 1) / elapsed, "steps": steps, "proposed": proposed,
            **({"phases_ms_per_step": phases.report(steps)} if phases is not None and speculation is not None else {}),
            "accepted": accepted, "acceptance": accepted / proposed if proposed else 0.0,
            "tokens": [t[:tokens] for t in out]}


def _mlx_lm(model: Any, prompt: list[int], tokens: int, k: int, prefill_step_size: int) -> dict[str, dict[str, Any]]:
    """mlx-lm at B=1 on the same prompt: `generate_step`, and `speculative_generate_step` with the model as draft."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    out = {}
    for name, steps in (
        ("mlx_lm plain", lambda: generate_step(mx.array(prompt), model, max_tokens=tokens,
                                               prefill_step_size=prefill_step_size)),
        ("mlx_lm spec", lambda: speculative_generate_step(mx.array(prompt), model, model, num_draft_tokens=k,
                                                          max_tokens=tokens, prefill_step_size=prefill_step_size)),
    ):
        got: list[int] = []
        start = 0.0
        for item in steps():
            got.append(int(item[0]))
            if len(got) == 1:
                start = time.perf_counter()  # after token 0, as the decode window above
        out[name] = {"tok_s": (tokens - 1) / (time.perf_counter() - start), "tokens": got[:tokens]}
    mx.clear_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="mlx-lm model directory")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny Llama, small sizes (a CPU check)")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--file-tokens", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=256, help="decoded tokens per row")
    parser.add_argument("--k", type=int, default=3, help="--num-draft-tokens")
    parser.add_argument("--ngram", type=int, default=3, help="--prompt-lookup-ngram")
    parser.add_argument("--edit-every", type=int, default=40)
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--draft", help="a draft model directory (same tokenizer) for the `draft` source")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--phases", action="store_true",
                        help="also run each source once more with its step's pieces timed alone (ms per step)")
    args = parser.parse_args(argv)
    prepare_thread()  # the engine's attention settings, before the first attention runs
    if args.tiny:
        from mlx_trio.testing.tiny_models import LLAMA, tiny_model
        model_dir = str(tiny_model(LLAMA))
        args.batches, args.file_tokens, args.tokens = "1,4", 300, 48
    elif args.model:
        model_dir = args.model
    else:
        parser.error("--model DIR or --tiny")
    model, _ = load(model_dir)
    draft = load(args.draft)[0] if args.draft else None
    vocab = model.args.vocab_size if hasattr(model, "args") else 512
    vocab = min(vocab, 1000)  # ids the tokenizer surely has (the random file needs no meaning)
    rows = []
    print(f"model {model_dir} | device {mx.default_device()} | attention {chosen_backend()} | "
          f"file {args.file_tokens} tokens | "
          f"{args.tokens} tokens/row | K={args.k} | edit every {args.edit_every}", flush=True)
    print("| B | source | tok/s | × plain | steps | tokens/step/row | acceptance | exact |")
    print("|---|---|---|---|---|---|---|---|")
    for B in [int(b) for b in args.batches.split(",")]:
        prompts = _prompts(B, args.file_tokens, vocab)
        _run(model, prompts[:1], 8, None, args.prefill_step_size)  # warm-up
        plain = _run(model, prompts, args.tokens, None, args.prefill_step_size)
        truth = {f"r{i}": t for i, t in enumerate(plain["tokens"])}
        n0 = len(prompts[0])

        def scripted(wrong: Any) -> SpeculationConfig:
            return SpeculationConfig(args.k, lambda rid, tokens: _Scripted(truth[rid], n0, tokens, wrong, vocab))

        sources = {"plain": None, "lookup": SpeculationConfig.prompt_lookup(args.k, args.ngram),
                   "echo": scripted(lambda i: False), "edit": scripted(lambda i: random.Random(i).random() < 1 / args.edit_every),
                   "reject": scripted(lambda i: True), "draft-self": SpeculationConfig.draft(model, args.k)}
        if draft is not None:
            sources["draft"] = SpeculationConfig.draft(draft, args.k)
        for name, speculation in sources.items():
            if name != "plain":  # its kernels compiled first, as the server's warm-up does (engine/batch/warmup.py)
                _run(model, prompts, 16, speculation, args.prefill_step_size)
            result = plain if name == "plain" else _run(model, prompts, args.tokens, speculation,
                                                        args.prefill_step_size)
            exact = result["tokens"] == plain["tokens"]
            per_step = (args.tokens - 1) / result["steps"] if result["steps"] else 0.0
            print(f"| {B} | {name} | {result['tok_s']:.1f} | {result['tok_s'] / plain['tok_s']:.2f} | "
                  f"{result['steps']} | {per_step:.2f} | {result['acceptance']:.0%} | {'yes' if exact else 'NO'} |",
                  flush=True)
            rows.append({"B": B, "source": name, **{k: v for k, v in result.items() if k != "tokens"},
                         "exact": exact})
            if args.phases and speculation is not None:
                phases = _Phases()
                real = decode_batch_module.row_rollback
                decode_batch_module.row_rollback = _TimedRollback(real, phases)
                try:
                    timed = _run(model, prompts, args.tokens, speculation, args.prefill_step_size, phases)
                finally:
                    decode_batch_module.row_rollback = real
                pieces = ", ".join(f"{k} {v:.2f}" for k, v in timed["phases_ms_per_step"].items())
                print(f"|   | {name} pieces (ms per step, each evaluated alone) | {pieces} |", flush=True)
                rows[-1]["phases_ms_per_step"] = timed["phases_ms_per_step"]
        if B == 1:
            for name, result in _mlx_lm(model, prompts[0], args.tokens, args.k, args.prefill_step_size).items():
                exact = result["tokens"] == plain["tokens"][0]
                print(f"| 1 | {name} | {result['tok_s']:.1f} | {result['tok_s'] / plain['tok_s']:.2f} | | | | "
                      f"{'yes' if exact else 'NO'} |", flush=True)
                rows.append({"B": 1, "source": name, "tok_s": result["tok_s"], "exact": exact})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_dir, "device": str(mx.default_device()), "args": vars(args), "rows": rows}, f,
                      indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
