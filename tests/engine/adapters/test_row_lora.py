"""Per-row adapters in the batch lane == mlx-lm's `load(model, adapter_path=...)` + `generate_step`, greedy.

Adapters are random (mlx_trio/testing/tiny_adapters.py: mlx-lm's own
`linear_to_lora_layers`, `lora_b` randomised), so each one changes the
tokens (asserted); a row with an adapter alone, rows of two adapters and base
rows in one batch (joining and leaving at different steps, a cohort
prefill of mixed adapters) each give exactly mlx-lm's tokens for that
adapter. Float32 on the CPU is batch-invariant here (tests/engine/batch/).
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_trio.engine.adapters.adapter_files import read_adapter
from mlx_trio.engine.adapters.resident import ResidentAdapters
from mlx_trio.engine.adapters.row_lora import RowLoraLinear
from mlx_trio.engine.batch.cohort_prefill import prefill_rows
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.errors import AdapterError, Overloaded
from mlx_trio.params import SamplingParams
from mlx_trio.testing.batch_reference import Arrival
from mlx_trio.testing.tiny_adapters import write_adapter
from mlx_trio.testing.tiny_models import LLAMA, QWEN3, TinyModelSpec, built_once, tiny_model
from tests.engine.batch.batch_driver import run_schedule

MAX_TOKENS = 16
ADAPTERS = {"qv": dict(seed=1, rank=8), "mlp": dict(seed=2, rank=4, keys=("mlp.down_proj", "self_attn.o_proj")),
            "dora": dict(seed=3, rank=8, dora=True), "last": dict(seed=4, rank=8, num_layers=1)}


def _prompt(i: int, n: int = 13) -> tuple[int, ...]:
    return tuple((7 * i + 5 * j + j * j) % 500 + 3 for j in range(n))


@cache
def _adapter_dir(spec_name: str, name: str) -> Path:
    """The adapter `name` for the tiny model, written once per machine (atomically: other processes may read it)."""
    spec = {"llama": LLAMA, "qwen3": QWEN3}[spec_name]
    params = json.dumps(ADAPTERS[name], sort_keys=True)
    digest = hashlib.sha256(params.encode()).hexdigest()[:12]
    path = Path(tiny_model(spec)).parent / f"adapters-{spec.cache_key()}" / f"{name}-{digest}"
    return built_once(path, lambda out: write_adapter(tiny_model(spec), out, **ADAPTERS[name]))


@cache
def _mlx_lm_tokens(spec_name: str, adapter: str | None, prompt: tuple[int, ...]) -> tuple[int, ...]:
    spec = {"llama": LLAMA, "qwen3": QWEN3}[spec_name]
    path = str(_adapter_dir(spec_name, adapter)) if adapter else None
    model, tokenizer = load(str(tiny_model(spec)), adapter_path=path)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return tuple(out)


def _served(spec_name: str, names: list[str], **kwargs: Any) -> tuple[Any, ResidentAdapters, Any]:
    spec = {"llama": LLAMA, "qwen3": QWEN3}[spec_name]
    model, tokenizer = load(str(tiny_model(spec)))
    resident = ResidentAdapters(model, **kwargs)
    for name in names:
        resident.register(read_adapter(name, _adapter_dir(spec_name, name), model, max_rank=resident.max_rank))
    return model, resident, tokenizer


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_one_row_equals_mlx_lm_with_its_adapter(adapter: str) -> None:
    model, resident, tokenizer = _served("llama", [adapter])
    prompt = _prompt(1)
    want = _mlx_lm_tokens("llama", adapter, prompt)
    assert want != _mlx_lm_tokens("llama", None, prompt)  # the adapter changes the output
    out = run_schedule(model, [Arrival("r", 0, prompt, SamplingParams(max_tokens=MAX_TOKENS))],
                       eos=tokenizer.eos_token_ids, adapter_of=lambda _: resident.acquire(adapter))
    assert tuple(out["r"].tokens) == want
    assert not resident.in_use(adapter)  # the row's leave released its slot


@pytest.mark.parametrize("spec_name", ["llama", "qwen3"])
def test_two_adapters_and_base_rows_batched_with_join_and_leave(spec_name: str) -> None:
    model, resident, tokenizer = _served(spec_name, ["qv", "dora"])
    # (adapter, join step, max_tokens): base and adapter rows join at different steps and finish at different ones.
    plan = [("qv", 0, MAX_TOKENS), (None, 0, MAX_TOKENS), ("dora", 2, MAX_TOKENS), ("qv", 3, 6), (None, 5, 9),
            ("dora", 6, MAX_TOKENS)]
    arrivals = [Arrival(f"r{i}", at, _prompt(i), SamplingParams(max_tokens=m)) for i, (_, at, m) in enumerate(plan)]
    adapter_of = {f"r{i}": name for i, (name, _, _) in enumerate(plan)}
    out = run_schedule(model, arrivals, eos=tokenizer.eos_token_ids,
                       adapter_of=lambda rid: resident.acquire(adapter_of[rid]) if adapter_of[rid] else None)
    for i, (name, _, max_tokens) in enumerate(plan):
        assert tuple(out[f"r{i}"].tokens) == _mlx_lm_tokens(spec_name, name, _prompt(i))[:max_tokens], (i, name)
    assert not resident.in_use("qv") and not resident.in_use("dora")


@pytest.mark.parametrize("compile_decode", [None, True])
def test_a_compiled_decode_step_never_serves_rows_with_adapters(compile_decode: bool | None) -> None:
    """A compiled trace holds the selection it was traced under: replayed for another mix of rows (same shapes) it
    gave a row another row's adapter. Rows with adapters step uncompiled (lone rows too: None compiles those)."""
    model, resident, tokenizer = _served("llama", ["qv", "dora"])
    # Lone rows one after another (base, qv, base: the same shapes), then the mixed batch of the test above.
    plan = [(None, 0, 4), ("qv", 6, 4), (None, 12, 4), ("qv", 18, MAX_TOKENS), (None, 18, MAX_TOKENS),
            ("dora", 20, MAX_TOKENS), ("qv", 21, 6), (None, 23, 9), ("dora", 24, MAX_TOKENS)]
    arrivals = [Arrival(f"r{i}", at, _prompt(i), SamplingParams(max_tokens=m)) for i, (_, at, m) in enumerate(plan)]
    adapter_of = {f"r{i}": name for i, (name, _, _) in enumerate(plan)}
    out = run_schedule(model, arrivals, eos=tokenizer.eos_token_ids, compile_decode=compile_decode,
                       adapter_of=lambda rid: resident.acquire(adapter_of[rid]) if adapter_of[rid] else None)
    for i, (name, _, max_tokens) in enumerate(plan):
        assert tuple(out[f"r{i}"].tokens) == _mlx_lm_tokens("llama", name, _prompt(i))[:max_tokens], (i, name)
    assert not resident.in_use("qv") and not resident.in_use("dora")


def test_cohort_prefill_of_mixed_adapters_then_one_batch() -> None:
    model, resident, tokenizer = _served("llama", ["qv", "mlp"])
    names = ["qv", None, "mlp", "qv"]
    makers = [lambda i=i, name=name: SoloRow(model, f"r{i}", _prompt(i, 9 + i), SamplingParams(max_tokens=MAX_TOKENS),
                                             adapter=resident.acquire(name) if name else None)
              for i, name in enumerate(names)]
    rows = prefill_rows(model, makers)
    assert all(isinstance(row, SoloRow) for row in rows)
    batch = DecodeBatch(model)
    batch.join_many([(row, row.token0) for row in rows])
    tokens = [[row.token0] for row in rows]
    for _ in range(MAX_TOKENS):
        decoded = batch.step_decoded()
        if decoded is not None:
            for got, token in zip(tokens, decoded.token_ids):
                got.append(token)
    for i, name in enumerate(names):
        want = _mlx_lm_tokens("llama", name, _prompt(i, 9 + i))
        assert tuple(tokens[i][: len(want)]) == want, (i, name)
    batch.close()
    assert not resident.in_use("qv") and not resident.in_use("mlp")


def test_no_adapter_installs_no_wrapper_and_base_rows_are_the_base_graph() -> None:
    model, resident, _ = _served("llama", [])
    assert not any(isinstance(m, RowLoraLinear) for _, m in model.named_modules())
    model, resident, _ = _served("llama", ["qv"])
    assert not any(isinstance(m, RowLoraLinear) for _, m in model.named_modules())  # wrapped at first use
    resident.acquire("qv").release()
    wrapped = [path for path, m in model.named_modules() if isinstance(m, RowLoraLinear)]
    assert wrapped and all(path.endswith(("q_proj", "v_proj")) for path in wrapped)


def test_lru_slots_and_a_held_slot_is_never_taken() -> None:
    model, resident, _ = _served("llama", ["qv", "mlp", "dora"], max_loras=2)
    a, b = resident.acquire("qv"), resident.acquire("mlp")
    with pytest.raises(Overloaded, match="--max-loras"):
        resident.acquire("dora")
    a.release()
    c = resident.acquire("dora")  # takes qv's slot, the least recently used one no row holds
    assert c.slot == a.slot
    b.release(), c.release()
    prompt = _prompt(3)
    out = run_schedule(model, [Arrival("r", 0, prompt, SamplingParams(max_tokens=MAX_TOKENS))], eos=(),
                       adapter_of=lambda _: resident.acquire("qv"))  # written back into a slot
    assert tuple(out["r"].tokens) == _mlx_lm_tokens("llama", "qv", prompt)[: len(out["r"].tokens)]


def test_an_adapter_for_another_shape_is_refused_naming_it_and_the_layer(tmp_path: Path) -> None:
    model, _ = load(str(tiny_model(LLAMA)))
    narrow = tiny_model(TinyModelSpec("llama", hidden_size=32, heads=2, kv_heads=1))
    other = write_adapter(narrow, tmp_path / "other", seed=5)
    with pytest.raises(AdapterError, match=r"adapter 'other' .*layer model\.layers\.0\.self_attn\.q_proj: lora_a "
                                           r"has shape \(32, 8\), the base model needs \(64, 8\)"):
        read_adapter("other", other, model, max_rank=16)
    big = write_adapter(tiny_model(LLAMA), tmp_path / "big", seed=6, rank=32)
    with pytest.raises(AdapterError, match="rank 32 is over --max-lora-rank 16"):
        read_adapter("big", big, model, max_rank=16)
    with pytest.raises(AdapterError, match="cannot read adapter_config.json"):
        read_adapter("missing", tmp_path / "nowhere", model, max_rank=16)


def test_revisions_for_the_trio_side_are_replaced_whole_on_register_and_unregister() -> None:
    _, resident, _ = _served("llama", ["qv", "mlp"])
    before = resident.revisions
    assert dict(before) == {"qv": resident.revision("qv"), "mlp": resident.revision("mlp")}
    assert resident.revision("qv") != resident.revision("mlp")  # the files' hash: another adapter, another root
    resident.unregister("mlp")
    assert dict(resident.revisions) == {"qv": resident.revision("qv")}
    assert "mlp" in before  # a reader holding the old mapping keeps it whole
    with pytest.raises(TypeError):
        resident.revisions["mlp"] = "x"  # type: ignore[index]
