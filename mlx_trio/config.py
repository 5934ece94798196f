"""Engine configuration: one frozen value, changed with `attrs.evolve`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from mlx_trio.params import SamplingParams

# The target time of one prefill chunk while other requests decode or wait (--prefill-chunk-ms):
# chosen from CPU and H200 measurements (docs/design.md §2.2).
DEFAULT_PREFILL_CHUNK_MS = 100.0
# Prompts prefilled at once, chunks interleaved (--prompt-concurrency; mlx_lm.server's default).
DEFAULT_PROMPT_CONCURRENCY = 8
# Keys (tokens) up to which cuDNN's prefill plans are built in idle time under prefill-only cuDNN: the reach
# the start-up plans (8192) and idle time (4x as far) had together before issue #46 (--cudnn-warm-tokens;
# docs/design.md §4.6).
DEFAULT_CUDNN_WARM_TOKENS = 32768
# Adapters resident at once (--max-loras: one per row of the default --batch) and their largest
# rank (--max-lora-rank, vLLM's default).
DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 16


def _lora_modules(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple((str(name), str(path)) for name, path in items)


def parse_batch(value: str | int | None) -> int | None:
    """`--batch`: "auto" (or None) is None, the row cap chosen at start (actors/row_cap.py); else an int >= 1.

    Raises ValueError naming the flag for anything else (argparse and the flag table turn it into a usage error).
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        rows = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--batch must be 'auto' or an integer >= 1, got {value!r}") from None
    if rows < 1:
        raise ValueError(f"--batch must be 'auto' or an integer >= 1, got {value!r}")
    return rows


# --kv-layout's values (vLLM's and mlx-lm's word for where KV lives).
AUTO, PAGED, PADDED = "auto", "paged", "padded"
KV_LAYOUTS = (AUTO, PAGED, PADDED)


@attrs.frozen
class KvLayoutChoice:
    """The KV layout in force, decided once at load, and why (the start-up log and `/v1/status` say both)."""

    paged: bool
    reason: str

    @property
    def layout(self) -> str:
        return PAGED if self.paged else PADDED

    def __str__(self) -> str:
        return f"{self.layout} ({self.reason})"


def refused_message(refusals: Iterable[str]) -> str:
    """`--kv-layout paged`'s start-up error: each conflict (naming its flag or the model), and what to change."""
    return (f"--kv-layout paged cannot serve here: {'; '.join(refusals)}. Change that, or use --kv-layout auto "
            f"(paged where it can serve) or padded")


def choose_kv_layout(requested: str, refusals: Sequence[str], kernel_off: str | None) -> KvLayoutChoice:
    """The layout `--kv-layout requested` runs with; pure (docs/design.md §6.5).

    `refusals`: why paged KV cannot serve this config and model, one sentence each naming the flag or the model
    (empty: it can). `kernel_off`: None when the backend has a paged decode kernel that passed its load-time
    self-check and was measured at par with the padded step there, else why not. `auto` is paged only with no
    refusal and a kernel: without the kernel a decode step gathers blocks with MLX ops, which costs what the
    padded step does not. Raises ValueError (`refused_message`) for `paged` with a refusal; `paged` without a
    kernel runs on the MLX-ops reference, as asked.
    """
    if requested == PADDED:
        return KvLayoutChoice(False, "--kv-layout padded")
    if requested == PAGED:
        if refusals:
            raise ValueError(refused_message(refusals))
        return KvLayoutChoice(True, "--kv-layout paged" + (f"; auto would not choose it: {kernel_off}"
                                                             if kernel_off is not None else ""))
    if requested != AUTO:
        raise ValueError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {requested!r}")
    if refusals:
        return KvLayoutChoice(False, f"auto: {'; '.join(refusals)}")
    if kernel_off is not None:
        return KvLayoutChoice(False, f"auto: {kernel_off}; --kv-layout paged forces blocks")
    return KvLayoutChoice(True, "auto: the model and flags allow blocks and the backend's paged decode kernel "
                                "passed its self-check")


@attrs.frozen
class EngineConfig:
    """Everything `open_engine` needs; flag names follow mlx_lm.server.

    `model` is an mlx-lm model directory, a hub id, or None for the embedded
    default (SmolLM2-135M-Instruct, converted once into `cache_dir`).
    `defaults` are the sampling values a request gets for fields it omits
    (mlx_lm.server's `--temp`, `--top-p`, `--max-tokens`, ...).
    """

    model: str | None = None
    # Concurrency cap = batch size (mlx_lm.server's --decode-concurrency). 1 caps
    # the lane at one row, the determinism pin: a lone row never shares a step.
    # None (`--batch auto`): chosen from the KV budget and the model once it loads (actors/row_cap.py).
    batch: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    # KV budget for admission; None derives it from device memory minus weights.
    kv_budget_bytes: int | None = None
    cache_dir: Path | None = None
    # Prompt cache (RAM tier): bytes (None: a fraction of the KV budget; 0: off) and entries.
    prompt_cache_bytes: int | None = None
    prompt_cache_size: int = 64
    # Prompt cache SSD tier: a directory (None: RAM only) and its byte cap.
    prompt_cache_dir: Path | None = None
    prompt_cache_ssd_bytes: int = 16 * 2**30
    prefill_step_size: int = 2048
    # While others decode or wait, a prefill chunk is sized to take about this long (never more
    # than prefill_step_size tokens); a lone request with nothing else running uses full chunks.
    prefill_chunk_ms: float = DEFAULT_PREFILL_CHUNK_MS
    # Prefill chunks end on multiples of this many tokens, so attention reuses few shapes' plans
    # (engine/batch/chunked_prefill.py); None: 256 on a GPU, off on the CPU; 0: off (--prefill-grid).
    prefill_grid: int | None = None
    # At most this many prompts prefill at once, their chunks interleaved (shortest first, with aging).
    prompt_concurrency: int = DEFAULT_PROMPT_CONCURRENCY
    max_queue: int = 256
    defaults: SamplingParams = SamplingParams()
    # Restart intensity of the engine subtree (lease → decoder), --max-restarts and
    # --restart-period: more than `max_restarts` within `restart_period_s` gives up, and
    # the engine is down (503s) until the root starts it again, after a backoff. Sized so
    # that faults arriving every 0.3 s for good are survived; an actor that crashes on every
    # start is slowed by the restart backoff and trips it (docs/supervision.md).
    max_restarts: int = 150
    restart_period_s: float = 30.0
    # A lease job running longer than this marks the lease dead: a new lease
    # thread starts and the engine subtree restarts (--step-watchdog).
    step_watchdog_s: float = 300.0
    # How long a request waits for a restarting engine before failing (engine_restarted).
    resume_timeout_s: float = 60.0
    # Longest one SSD-tier file operation may take before the disk counts as hung and the SSD
    # tier is turned off, RAM only (--prompt-cache-io-timeout; actors/cache_persistence.py).
    prompt_cache_io_timeout_s: float = 10.0
    # KV storage (mlx_lm.server's --kv-bits, --kv-group-size, --quantized-kv-start): None is bf16,
    # 4 or 8 quantizes full-attention KV once a row holds quantized_kv_start tokens (docs/design.md,
    # "Quantized KV"; engine/kv/kv_scheme.py). 5000 is mlx-lm's default start.
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    # Speculative decoding (mlx_lm.server's --num-draft-tokens): proposals verified per row and step.
    num_draft_tokens: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    # Prompt lookup (--prompt-lookup): propose what followed the row's last n tokens (n <= the ngram max)
    # earlier in its prompt or output; the tokens are those of plain decoding (docs/design.md §9).
    prompt_lookup: bool = False
    prompt_lookup_ngram: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    # A draft model (--draft-model: directory or hub id, same tokenizer): it proposes each row's next
    # --num-draft-tokens tokens, batched; with it, --prompt-lookup is not used.
    draft_model: str | None = None
    # LoRA/DoRA adapters (mlx-lm adapter directories) served by name next to the base model
    # (--lora-modules NAME=PATH), at most `max_loras` resident at once (LRU beyond), of rank at
    # most `max_lora_rank`; `enable_lora_admin` lets adapters be loaded and unloaded at run time.
    lora_modules: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_lora_modules)
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    enable_lora_admin: bool = False

    # Scale-out (docs/scale-out.md): rank 0 runs a heartbeat collective this often, and a follower
    # that has not answered one within collective_timeout_s is lost (/health says so).
    heartbeat_s: float = 1.0
    collective_timeout_s: float = 10.0

    # Decode steps run the model's forward as one compiled graph where the caches allow (--no-compile
    # turns it off; engine/batch/compiled_step.py). None: a lone row's
    # steps on the CPU only (on CUDA its masked attention misses the fused decode kernel and lost on the
    # H200; over a batch it attends the whole masked buffer); True: batches too; never while adapters are
    # served (their per-row arrays and wrapped layers would be trace constants).
    compile_decode: bool | None = None
    # Under prefill-only cuDNN attention (MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill), cuDNN's plans of the
    # prefill grid's chunk shapes whose keys end within this many tokens are built in idle time, never before
    # the first request (actors/plan_warmup.py); 0: none (--cudnn-warm-tokens).
    cudnn_warm_tokens: int = DEFAULT_CUDNN_WARM_TOKENS
    # Where full-attention KV lives (--kv-layout; docs/design.md §6.5): "paged" in blocks of one pool the size of
    # the KV budget, made at load, whose cached prefix blocks replace the prompt cache; "padded" in each batch's
    # buffers padded to its longest row (docs/design.md §6.1); "auto" paged where `choose_kv_layout` allows it,
    # decided at load.
    kv_layout: str = attrs.field(default=AUTO, validator=attrs.validators.in_(KV_LAYOUTS))

    def __attrs_post_init__(self) -> None:
        if self.kv_layout == PAGED and self.paged_conflicts:
            raise ValueError(refused_message(self.paged_conflicts))

    @property
    def serves_adapters(self) -> bool:
        """Whether adapters may be served: some are configured, or they can be loaded at run time."""
        return bool(self.lora_modules) or self.enable_lora_admin

    @property
    def prompt_cache_off(self) -> bool:
        """No RAM tier, and so no SSD tier: `--prompt-cache-bytes 0`, `--prompt-cache-size 0`, or `--batch 1`.

        Under paged KV (`--kv-layout`) the pool's cached blocks replace the RAM tier, and the SSD tier
        (`--prompt-cache-dir`) stores those blocks instead (actors/block_persistence.py).

        At `--batch 1` every prompt prefills from scratch, so a request's bits
        depend on no other request, not even an earlier one's cached KV.
        """
        return self.prompt_cache_bytes == 0 or self.prompt_cache_size <= 0 or self.batch == 1

    @property
    def paged_conflicts(self) -> tuple[str, ...]:
        """The flags that keep KV off the paged layout, each with why: an error at start under `--kv-layout
        paged`, the padded layout under `auto`. The model's own reasons come at load (`paged_refusals`)."""
        return tuple(reason for on, reason in (
            (self.kv_bits is not None, "--kv-bits: quantized KV is not on the paged layout yet"),
            (self.draft_model is not None, "--draft-model: the draft's KV would live outside the block pool"),
            # Cached prefix blocks are a prompt cache, which --batch 1 promises not to have.
            (self.batch == 1, "--batch 1: it promises no prompt cache, and cached prefix blocks are one"),
        ) if on)
