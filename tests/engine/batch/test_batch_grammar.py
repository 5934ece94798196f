"""Constrained rows in the continuous batch: outputs always validate, plain rows beside them are untouched.

A driver joins and leaves rows mid-decode exactly as the decode-step actor
does (flush, leave the finished, join prefilled rows, step), with grammar
rows (greedy and seeded) beside plain rows (greedy and seeded). Schemas are
hypothesis-generated and bounded (string lengths, integer ranges, array
sizes, closed objects), so every constrained output is finite: each must end
with "stop" and validate against its schema (`jsonschema`). Plain rows must
produce exactly their tokens alone (B=1): sharing a batch with a grammar row
(which makes each step read the register before queueing) changes nothing.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load

from tests.engine.batch.batch_driver import Arrival, run_schedule, solo_run
from mlx_trio.engine.sampling.grammar import build_grammar_tokenizer
from mlx_trio.params import Constraint, SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

# Enough for the largest output the bounded schemas below allow.
GRAMMAR_MAX_TOKENS = 600


@cache
def _model() -> tuple[Any, Any, Any]:
    model, tokenizer = load(str(tiny_model(LLAMA)))
    return model, tokenizer, build_grammar_tokenizer(tokenizer, tokenizer.eos_token_ids)


def run(arrivals: list[Arrival]) -> dict[str, Any]:
    model, tokenizer, grammar_tokenizer = _model()
    return run_schedule(model, arrivals, eos=set(tokenizer.eos_token_ids), grammar_tokenizer=grammar_tokenizer)


def solo_tokens(prompt_ids: tuple[int, ...], params: SamplingParams) -> list[int]:
    model, tokenizer, grammar_tokenizer = _model()
    return solo_run(model, prompt_ids, params, eos=set(tokenizer.eos_token_ids),
                      grammar_tokenizer=grammar_tokenizer).tokens


def _prompt(i: int, n: int) -> tuple[int, ...]:
    return tuple((13 * i + 7 * j + j * j) % 500 + 3 for j in range(n))


NAMES = st.sampled_from(["a", "b", "id", "name", "tags", "ok"])
LEAVES = st.one_of(
    st.integers(1, 5).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-20, 0), st.integers(0, 30)).map(
        lambda r: {"type": "integer", "minimum": r[0], "maximum": r[1]}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", 7, None, False]), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}),
)


def _arrays(items: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(items, st.integers(0, 2), st.integers(0, 1)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1], "minItems": min(t[1], t[2])})


def _objects(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    # Every property required but at most one: a random model, free to, would mostly close `{}` at once.
    return st.dictionaries(NAMES, values, min_size=1, max_size=3).flatmap(
        lambda props: st.sampled_from([None, *sorted(props)]).map(
            lambda optional: {"type": "object", "properties": props,
                              "required": [name for name in props if name != optional],
                              "additionalProperties": False}))


SCHEMAS = _objects(st.recursive(LEAVES, lambda inner: _arrays(inner) | _objects(inner), max_leaves=4))


@settings(max_examples=10, derandomize=True)
@given(schemas=st.lists(SCHEMAS, min_size=2, max_size=2))
def test_schema_rows_validate_beside_plain_rows_joining_and_leaving(schemas: list[dict[str, Any]]) -> None:
    """20 schemas (2 per example) at B=4 with plain rows: every constrained output stops and validates."""
    _, tokenizer, _ = _model()
    greedy_json = SamplingParams(max_tokens=GRAMMAR_MAX_TOKENS, constraint=Constraint("json_schema", json.dumps(schemas[0])))
    seeded_json = SamplingParams(max_tokens=GRAMMAR_MAX_TOKENS, temperature=1.0, seed=11,
                                 constraint=Constraint("json_schema", json.dumps(schemas[1])))
    plain_greedy = SamplingParams(max_tokens=9)
    plain_seeded = SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=5, logprobs=True, top_logprobs=2)
    arrivals = [
        Arrival("plain-greedy", 0, _prompt(0, 11), plain_greedy),
        Arrival("json-greedy", 0, _prompt(1, 5), greedy_json),
        Arrival("plain-seeded", 2, _prompt(2, 17), plain_seeded),
        Arrival("json-seeded", 4, _prompt(3, 9), seeded_json),
        Arrival("plain-late", 12, _prompt(4, 6), plain_greedy),  # joins after the first plain row left
    ]
    out = run(arrivals)
    for arrival, schema in (("json-greedy", schemas[0]), ("json-seeded", schemas[1])):
        outcome = out[arrival]
        assert outcome.finish_reason == "stop", (schema, tokenizer.decode(outcome.tokens))
        value = json.loads(tokenizer.decode(outcome.tokens[:-1]))
        jsonschema.validate(value, schema)
    for a in arrivals:
        if a.params.constraint is None:
            assert out[a.request_id].tokens == solo_tokens(a.prompt_ids, a.params), a.request_id


def test_json_object_row_is_an_object() -> None:
    """json_object (any object) with `}` favoured: the row writes `{}`, then stops."""
    _, tokenizer, _ = _model()
    close = tokenizer.encode("}")
    params = SamplingParams(max_tokens=20, logit_bias=((close[0], 30.0),),
                            constraint=Constraint("json_schema", '{"type": "object"}'))
    out = run([Arrival("obj", 0, _prompt(5, 7), params), Arrival("plain", 0, _prompt(6, 7),
                                                                          SamplingParams(max_tokens=30))])
    assert out["obj"].finish_reason == "stop"
    assert json.loads(tokenizer.decode(out["obj"].tokens[:-1])) == {}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_lone_constrained_row_stops_and_validates(temperature: float) -> None:
    """A constrained row alone (`--batch 1`) stops and validates too, and equals itself beside a plain row."""
    _, tokenizer, _ = _model()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    params = SamplingParams(max_tokens=80, temperature=temperature, seed=3,
                            constraint=Constraint("json_schema", json.dumps(schema)))
    prompt = _prompt(7, 10)
    tokens = solo_tokens(prompt, params)
    assert tokens[-1] in tokenizer.eos_token_ids
    jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), schema)
    beside = run([Arrival("json", 0, prompt, params), Arrival("plain", 0, _prompt(8, 10), SamplingParams(max_tokens=30))])
    assert beside["json"].tokens == tokens
