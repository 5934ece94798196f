"""The goldens, mlx-lm's own outputs (written only by scripts/make_goldens.py), for the tests.

goldens/tiny.json holds the tiny models' cases, goldens/smollm2.json the
default model's (the slow tier). `replay` runs one case through an engine and
asserts it token for token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_trio import Engine
from mlx_trio.events import Finished, TextDelta

_DIR = Path(__file__).resolve().parents[1] / "goldens"


def load_goldens(name: str) -> dict[str, Any]:
    """goldens/<name>.json."""
    return json.loads((_DIR / f"{name}.json").read_text())


GOLDENS: dict[str, Any] = load_goldens("tiny")


def golden(model: str, name: str) -> dict[str, Any]:
    """The case `name` of tiny model `model`."""
    return next(c for c in GOLDENS["cases"] if c["model"] == model and c["name"] == name)


async def replay(engine: Engine, case: dict[str, Any]) -> None:
    """Same prompt ids, same generated ids (EOS included in the count), same text, same finish reason."""
    request = engine.prepare(case["prompt"], **case["params"])
    assert list(request.prompt_ids) == case["prompt_ids"]
    ids: list[int] = []
    text = ""
    finished = None
    async for event in engine.stream(request):
        if isinstance(event, TextDelta):
            ids.extend(event.token_ids)
            text += event.text
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    golden = case["tokens"]
    eos = set(engine.model.eos_token_ids)
    # Our token_ids leave the EOS out (decode(ids) == text); usage counts it, as mlx_lm.server does.
    assert ids == [t for t in golden if t not in eos]
    assert finished.usage.completion_tokens == len(golden)
    assert finished.usage.prompt_tokens == len(case["prompt_ids"])
    assert finished.finish_reason == case["finish_reason"]
    assert text == case["text"]
