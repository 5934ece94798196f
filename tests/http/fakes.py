"""A fake engine with the small surface the HTTP layer uses, for tests that need no model."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any

import attrs
import trio

from mlx_trio.engine.model.chat import check_chat
from mlx_trio.errors import ContextTooLong, EngineFailure, InvalidParameter, MlxTrioError
from mlx_trio.events import Finished, GenerationEvent, PromptProgress, TextDelta, Usage
from mlx_trio.output_format import PLAIN, OutputFormat
from mlx_trio.params import SamplingParams
from mlx_trio.supervision.faults import Faults


@attrs.frozen
class FakeRequest:
    prompt_tokens: int
    params: SamplingParams

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        # Token 0 only: no marker of a real model's format (a think start would start in reasoning).
        return (0,) * self.prompt_tokens


class FakeEngine:
    """Streams the words "w0 w1 w2 ..." one per token; loading, failures and delays are switches.

    `loaded` False: health is 503 "loading model" and prepare raises EngineFailure.
    `fail_with`: an error `stream` raises after its first progress event;
    `fail_before_start`: one it raises before any event (as a full queue does).
    `token_delay_s`: sleep per token, so a client can disconnect mid-stream.
    `active` / `kv_bytes` mimic the engine counters and drop when a stream is closed.
    """

    def __init__(self, *, loaded: bool = True, context_length: int = 64) -> None:
        self.loaded = loaded
        self.context_length = context_length
        self.fail_with: MlxTrioError | None = None
        self.fail_before_start: MlxTrioError | None = None
        self.token_delay_s = 0.0
        self.active = 0
        self.kv_bytes = 0
        self.closed_streams = 0
        self.prepared: list[tuple[Any, dict[str, Any]]] = []
        self.faults = Faults()
        self.group_lost: str | None = None  # never a scale-out rank 0
        self.output_format: OutputFormat = PLAIN

    def health(self) -> tuple[bool, str]:
        return (True, "ok") if self.loaded else (False, "loading model")

    def status(self) -> dict[str, Any]:
        return {"tree": {"id": "root", "state": "running", "children": []}, "model": "fake",
                "counters": {"active_rows": self.active, "pending_rows": 0, "lease_queue_depth": 0,
                             "lease_busy_fraction": 0.0, "kv_bytes": self.kv_bytes}}

    def served_adapters(self) -> tuple[str, ...]:
        return ()

    @property
    def model_id(self) -> str:
        if not self.loaded:
            raise EngineFailure("the model is not loaded yet")
        return "fake-model"

    def prepare(self, prompt: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                tools: Any = None, clamp_max_tokens: bool = True, model: str | None = None,
                **sampling: Any) -> FakeRequest:
        """One token per word (per message for a chat); the engine's context policy over `context_length`."""
        if not self.loaded:
            raise EngineFailure("the model is not loaded yet")
        self.prepared.append((prompt, {"chat_template_kwargs": chat_template_kwargs, "tools": tools, **sampling}))
        params = SamplingParams.from_kwargs(sampling).validate(vocab_size=100)
        n = self.count_tokens(prompt, chat_template_kwargs=chat_template_kwargs, tools=tools)
        if n >= self.context_length:
            raise ContextTooLong(f"prompt is too long: {n} tokens > {self.context_length - 1} maximum")
        if n + params.max_tokens > self.context_length:
            if not clamp_max_tokens:
                raise ContextTooLong(f"{n} + {params.max_tokens} tokens is over the context of {self.context_length}")
            params = attrs.evolve(params, max_tokens=self.context_length - n)
        if isinstance(prompt, str) and "bad-prompt" in prompt:
            raise InvalidParameter("prompt", "contains bad-prompt")
        return FakeRequest(n, params)

    def count_tokens(self, prompt: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                     tools: Any = None, **_sampling: Any) -> int:
        if not self.loaded:
            raise EngineFailure("the model is not loaded yet")
        if isinstance(prompt, list) and all(isinstance(m, Mapping) for m in prompt):
            # The engine's own semantic checks, as `LoadedModel.encode` runs them.
            check_chat(prompt, template_args=chat_template_kwargs or {}, tools=tools,
                       output_format=self.output_format, model_id=self.model_id)
        return len(prompt) if isinstance(prompt, (list, tuple)) else len(prompt.split())

    async def prepare_off_loop(self, prompt: Any, **kwargs: Any) -> FakeRequest:
        return self.prepare(prompt, **kwargs)

    async def stream(self, request: FakeRequest) -> AsyncGenerator[GenerationEvent, None]:
        if self.fail_before_start is not None:
            raise self.fail_before_start
        self.active += 1
        self.kv_bytes += 1000
        try:
            yield PromptProgress(0, request.prompt_tokens)
            if self.fail_with is not None:
                raise self.fail_with
            yield PromptProgress(request.prompt_tokens, request.prompt_tokens)
            text = ""
            for i in range(request.params.max_tokens):
                await trio.sleep(self.token_delay_s)
                word = f"w{i} "
                stop = next((s for s in request.params.stop if s in text + word), None)
                if stop is not None:
                    yield TextDelta((text + word)[len(text):(text + word).index(stop)], (i,))
                    yield Finished("stop", Usage(request.prompt_tokens, i + 1), stop_sequence=stop)
                    return
                text += word
                yield TextDelta(word, (i,))
            yield Finished("length", Usage(request.prompt_tokens, request.params.max_tokens))
        finally:
            self.active -= 1
            self.kv_bytes -= 1000
            self.closed_streams += 1


class ScriptedEngine(FakeEngine):
    """Answers each request with the next scripted text, a few characters per delta, then "stop".

    `output_format` is a real model's (e.g. the QWEN3_TOOLS tiny model's, read
    by mlx-lm), so the HTTP layer splits the script as it would that model's
    output; small deltas cut the markers in pieces. `prepared` records each
    request's prompt and keywords, `tools` included.
    """

    def __init__(self, output_format: OutputFormat, scripts: list[str], *, chars_per_delta: int = 3) -> None:
        super().__init__(context_length=100_000)
        self.output_format = output_format
        self.scripts = list(scripts)
        self.chars_per_delta = chars_per_delta

    async def stream(self, request: FakeRequest) -> AsyncGenerator[GenerationEvent, None]:
        text = self.scripts.pop(0)
        yield PromptProgress(request.prompt_tokens, request.prompt_tokens)
        step = self.chars_per_delta
        for i in range(0, len(text), step):
            await trio.lowlevel.checkpoint()
            yield TextDelta(text[i:i + step], (i,))
        yield Finished("stop", Usage(request.prompt_tokens, len(text)))
