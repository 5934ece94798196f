"""Sampling parameters: one frozen value per request, validated once.

Pure data (no MLX, no Trio) so that every layer can hold it: the HTTP layer
builds it from JSON, the session actor carries it, and `engine/sampling/processors.py`
turns it into mlx-lm samplers and logits processors on the lease thread.
Validation happens before a request reaches any actor, so bad input raises
`InvalidParameter` in the caller and can never kill an actor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from mlx_trio.errors import InvalidParameter

# mlx_lm.server's defaults: a context of 20 tokens for each penalty.
DEFAULT_PENALTY_CONTEXT = 20
# OpenAI's limit for chat's `top_logprobs`; the top-k is computed on the device per token.
MAX_TOP_LOGPROBS = 20


@attrs.frozen
class Constraint:
    """A grammar the output must follow, enforced token by token (engine/sampling/grammar.py).

    `kind` "json_schema": `source` is the schema's JSON text. `kind` "lark":
    `source` is an llguidance Lark grammar (which may embed `%json {...}`).
    The grammar is compiled and checked in `Engine.prepare`, so a bad one is
    an `InvalidParameter` naming the field "constraint".

    `schemas` label the JSON schemas a lark grammar embeds with the request
    field each came from, as (field, schema JSON text) pairs (a tool call
    grammar embeds every tool's parameters). When the grammar does not
    compile, each is checked on its own and the error names the field of the
    first bad one; the grammar itself, which the caller never wrote, is not shown.
    """

    kind: Literal["json_schema", "lark"]
    source: str
    schemas: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class SamplingParams:
    """How one request samples and when it stops.

    Field names and defaults follow mlx_lm.server (and OpenAI where they
    overlap): `temperature` 0 means greedy argmax, `top_p` 1 / `top_k` 0 /
    `min_p` 0 and penalties 0 mean "off". `stop` holds stop *strings*,
    matched on detokenized text.
    """

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    repetition_context_size: int = DEFAULT_PENALTY_CONTEXT
    presence_penalty: float = 0.0
    presence_context_size: int = DEFAULT_PENALTY_CONTEXT
    frequency_penalty: float = 0.0
    frequency_context_size: int = DEFAULT_PENALTY_CONTEXT
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None
    # Report the sampled token's logprob (and the `top_logprobs` most likely tokens')
    # from the row's processed distribution: after logits processors and the grammar mask.
    logprobs: bool = False
    top_logprobs: int = 0
    # Whether this request may decode speculatively when the engine speculates (--prompt-lookup):
    # a switch for the rare client that wants no proposals at all; greedy and seeded tokens are the same either way.
    speculative: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> SamplingParams:
        """Build from loosely typed keyword arguments, raising `InvalidParameter`.

        Accepts what a JSON body or a Python caller naturally passes: `stop` as
        a string or a list of strings, `logit_bias` as a mapping with int or
        numeric-string keys. Unknown names are rejected so a typo never
        silently changes nothing.
        """
        fields = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise InvalidParameter(unknown[0], f"unknown sampling parameter; known: {', '.join(sorted(fields))}")
        values: dict[str, Any] = {}
        for name, value in kwargs.items():
            if value is None and name != "seed":
                continue  # None means "use the default", as in OpenAI clients
            values[name] = _coerce(name, value)
        return cls(**values)

    def validate(self, *, vocab_size: int) -> SamplingParams:
        """Check ranges that depend on the model; returns self for chaining."""
        if self.max_tokens <= 0:
            raise InvalidParameter("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidParameter("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            # As in mlx-lm, nucleus filtering applies only for 0 < top_p < 1.
            raise InvalidParameter("top_p", f"must be in [0, 1], got {self.top_p}")
        if not 0 <= self.top_k < vocab_size:
            raise InvalidParameter("top_k", f"must be >= 0 and < the vocabulary size {vocab_size}, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty < 0:
            raise InvalidParameter("repetition_penalty", f"must be >= 0 (0 disables it), got {self.repetition_penalty}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            if not 1 <= getattr(self, name) <= _MAX_INT32:
                raise InvalidParameter(name, f"must be in [1, {_MAX_INT32}], got {getattr(self, name)}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidParameter("seed", f"must be in [0, 2**64), got {self.seed}")
        for token_id, _ in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                raise InvalidParameter("logit_bias", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
        if any(s == "" for s in self.stop):
            raise InvalidParameter("stop", "stop strings must be non-empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParameter("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        return self


_MAX_INT32 = 2**31 - 1  # MLX slices and gathers take 32-bit indices

_INT_FIELDS = {"max_tokens", "top_k", "repetition_context_size", "presence_context_size", "frequency_context_size",
               "seed", "top_logprobs"}
_FLOAT_FIELDS = {
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
}


def _coerce(name: str, value: Any) -> Any:
    if name in _INT_FIELDS:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidParameter(name, f"must be an integer, got {type(value).__name__} {value!r}")
        return value
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidParameter(name, f"must be a number, got {type(value).__name__} {value!r}")
        if not fits_a_float(value):  # a JSON body with one is refused earlier, in http/server/body.py
            raise InvalidParameter(name, f"must be a finite number in float range, got {value!r:.40}")
        return float(value)
    if name in ("logprobs", "speculative"):
        if not isinstance(value, bool):
            raise InvalidParameter(name, f"must be a boolean, got {type(value).__name__} {value!r}")
        return value
    if name == "constraint":
        if not isinstance(value, Constraint):
            raise InvalidParameter(name, f"must be a Constraint, got {type(value).__name__}")
        if value.kind not in ("json_schema", "lark") or not isinstance(value.source, str):
            raise InvalidParameter(name, f"kind must be 'json_schema' or 'lark' with a str source, got {value.kind!r}")
        return value
    if name == "stop":
        return _coerce_stop(value)
    if name == "logit_bias":
        return _coerce_logit_bias(value)
    return value


def fits_a_float(number: float) -> bool:
    """Finite and within float's range (an int past it is not, though Python holds it exactly)."""
    try:
        return math.isfinite(number)  # an int past float's range raises, as float() would
    except OverflowError:
        return False


def _coerce_stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise InvalidParameter("stop", f"must be a string or a list of strings, got {type(value).__name__}")


def _coerce_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = list(value)
    else:
        raise InvalidParameter("logit_bias", f"must be a mapping of token id to bias, got {type(value).__name__}")
    out = []
    for item in items:
        try:
            key, bias = item
            token_id = int(key)
        except (TypeError, ValueError):
            raise InvalidParameter("logit_bias", f"keys must be token ids (integers), got {item!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not fits_a_float(bias):
            raise InvalidParameter("logit_bias", f"bias for token {token_id} must be a finite number, got {bias!r}")
        out.append((token_id, float(bias)))
    return tuple(out)
