#!/bin/bash
# mlx-trio vs mlx-lm on an NVIDIA H200 (MLX's CUDA backend): random-weight Llama-1B and Llama-8B shaped
# models (bf16) built on the device, then
#   engine (optional): B=1 decode (ours, at --batch 1 and --batch N) vs mlx-lm stream_generate; aggregate decode at
#           B=8/32/64 (ours, batch lane) vs mlx-lm BatchGenerator; the fraction of the HBM bandwidth limit
#           that B=1 reaches (weights read once per step);
#   http:   `python -m mlx_trio.bench --serve ours --serve mlx_lm --workload agents` (the same table as on CPU);
#   long:   the same with --workload long-prompt: the decode stall while an ~8k-token prompt is prefilled.
#   agentloop: --workload agent-loop: 8 agents, zero think time, 300-word tool results: per-turn cached
#           fraction, TTFT, prefill stall (issue #19). Run it with PARTS="agentloop long".
#   kvquant: benchmarks/kv_quant.py (issue #22): rows a 40 GiB --kv-budget admits at 8k/32k tokens for
#           bf16 / 8-bit / 4-bit KV; which --kv-bits x --kv-group-size pairs attention over quantized KV runs
#           (and runs right) for; and, for bf16 and each pair that runs, aggregate decode tok/s at B=1/8/32 of
#           8k-token rows and the TTFT of one 8k prompt. Run it with MODELS="1b 8b" PARTS=kvquant (150 s per
#           model at most).
#   speculative: benchmarks/speculative.py (issue #23): "edit this file" (2k-token prompts), prompt lookup and
#           scripted proposals (echo / edit / reject) vs plain decoding at B=1/4/16. PARTS=speculative, ~1-2 min.
#   spechttp: the agents workload over HTTP, ours vs mlx_lm.server, both with the model as its own --draft-model
#           (mlx_lm.server serves draft requests one at a time; ours batches them). PARTS=spechttp, <= SPEC_HTTP_LIMIT_S.
#   cudnn:  prefill-only cuDNN attention (issue #19), about 240 s: stall_profile.py (4 streams, an 8.5k prompt,
#           3 rounds, --prefill-chunk-ms 40 and 100) with MLX_TRIO_ATTENTION_BACKEND=mlx, then =cudnn-prefill
#           with cuDNN's plans of every chunk shape up to CUDNN_WARM_TOKENS (9216) built at the engine's start
#           (each backend a fresh process: MLX reads its variable once), then the agent-loop workload (8 agents,
#           CUDNN_AGENT_REQUESTS=24) with ours-mlx-attention, ours and mlx_lm.server in one run.
#           Limits: CUDNN_STALL_MLX_LIMIT_S (60), CUDNN_STALL_LIMIT_S (95), CUDNN_AGENT_LIMIT_S (85); more bench
#           flags in CUDNN_AGENT_ARGS. MODELS=1b PARTS=cudnn. On a CPU: CUDNN_STALL_ARGS="--long-tokens 1500
#           --rounds 1 --stream-tokens 600" CUDNN_AGENT_REQUESTS=4.
#   profile: benchmarks/serving_profile.py (issue #20): `mlx-trio serve` under MLX_TRIO_PROFILE at c=8/64/256
#           (--batch 8/64/64), the serving workload (prompts ~100-10k tokens, Poisson arrivals, mixed per-row
#           sampling): tok/s, TTFT, lease and GPU busy, per-token/step/job/request CPU of the lease and Trio
#           threads, top jobs and sampled functions. PARTS=profile MODELS=1b, <= PROFILE_LIMIT_S (240).
#   options: benchmarks/serve_vs_engine.py (issue #20's Done-when): the engine's decode tok/s at B=8/64 (in the
#           script's process) vs ONE `mlx-trio serve --batch 64` under closed-loop uniform loads at c=8/64 (8-word
#           prompts, 256 tokens, 2 x c requests): greedy, a 2-token logit_bias, penalties and mixed options per row,
#           and ~1200-token prompts with a logit_bias; 2 rounds, order alternated; the Done-when ratios. MODELS=1b
#           PARTS=options, <= OPTIONS_LIMIT_S (300); the 8B point (64 rows >= 3x the tok/s of 8): MODELS=8b
#           PARTS=options OPTIONS_ARGS="--kinds greedy --concurrency 8,64"; OPTIONS_ARGS=--mlx-lm adds mlx_lm.server.
#           On a CPU: OPTIONS_ARGS="--concurrency 2,4 --batch 4 --output-tokens 8 --long-prompt-words 40 --rounds 1".
#   ragged: benchmarks/ragged_attention.py (issues #20, #25): the ragged decode-attention kernel against MLX's
#           masked attention (max abs error, B=1/8/64, T=256/2048/10000, GQA 32/8 at D=64 and 128, bf16 and fp32;
#           a non-zero status past bf16's tolerance or on an NVRTC error, which it prints; fp32 is measured, not
#           routed), µs per call vs the masked
#           and the unmasked (vector) attention, and a B=64 DecodeBatch of 100-10k-token rows: greedy tokens and
#           ms per step, kernel on vs off. PARTS=ragged MODELS=1b, <= RAGGED_LIMIT_S (150).
#   knobs:  benchmarks/cuda_graph_knobs.py --settings fused,unfused --rounds 3 (issues #20, #25): decode step ms at
#           B=1/8/64 and a 512-token prefill chunk with fused q/k/v + gate/up projections (the default) vs
#           MLX_TRIO_NO_FUSED_PROJECTIONS=1, one child process per setting, rounds alternated, and the B=8 greedy
#           tokens of each setting against the first's. PARTS=knobs MODELS=1b, <= KNOBS_LIMIT_S (200); other
#           settings with KNOBS_SETTINGS (e.g. default,ops300,nographs).
#   anatomy: benchmarks/step_anatomy.py (issues #20, #25): one decode step's host time cut into graph building, MLX's
#           launch (`mx.async_eval`) and the token read, engine vs bare loop at ANATOMY_BATCHES (1,8,64), and the
#           primitives of one step's graph by kind. PARTS=anatomy, <= ANATOMY_LIMIT_S (150); ANATOMY_ARGS for more flags
#           (e.g. "--shape llama-1b --num-layers 2" for what one layer adds).
#   cohorts: benchmarks/cohort_shapes.py (issue #20): one cohort prefill job (`prefill_rows`) by rows (1..32 short
#           prompts), at padded shapes new to the process vs seen; COHORTS_ARGS for more flags. PARTS=cohorts,
#           <= COHORTS_LIMIT_S (120).
#   prefillrate: benchmarks/prefill_budget.py (issue #46: prefill under load >= 0.8x a lone prompt's): tok/s from
#           submit to token 0 of PREFILLRATE_TOKENS (12288) prompts alone and beside --batch - 2 decoding rows for
#           PREFILLRATE_BATCHES ("8 64"). PARTS=prefillrate MODELS=1b, <= PREFILLRATE_LIMIT_S (150).
#   paged:  benchmarks/paged_kv.py (issue #45): decode ms a step of 8 and 64 equal 512-token rows, paged vs padded
#           (target within 5 %); KV bytes held per token of a PAGED_LONG (30000) row beside 15 short ones; 8 siblings
#           sharing a PAGED_PREFIX (12400) token prefix: prompt tokens computed and seconds, paged vs padded; one
#           lone 8192- and 32768-token prompt prefilled as the server does (chunks of 2048 and 512, on the grid,
#           the server's attention backend): tok/s paged vs padded (target >= 0.95), first tokens equal (exit 1).
#           PARTS=paged MODELS=1b, <= PAGED_LIMIT_S (300); PAGED_PARTS to pick (equal,memory,siblings,prefill,block).
#   distributed: benchmarks/distributed.py (issue #27): 2 tensor-parallel ranks vs 1 (tok/s, TTFT, the
#           broadcast's cost per lease job). Needs 2 GPUs (NCCL: one rank per GPU; kind nvidia-h200-x2):
#           MODELS=1b PARTS=distributed DIST_BACKEND=nccl (about 2 minutes after the model is built).
#
# Here, once: bash ../shared/device/mlx-cuda.sh (stages .mlxcuda1/ and .mlxcuda2/, git-ignored). Both together
# exceed the 64 MiB a call carries, so, as in docs/lab-notes/README.md, "Reproducing the H200 runs":
#   call 1, carry [".mlxcuda1"]:  mkdir -p $HOME/.mlxcuda-stage && cp .mlxcuda1/* $HOME/.mlxcuda-stage/
#   call 2 at once (the machine stays warm ~30 s), carry [".mlxcuda2"], timeout_s 600:
#          MODELS=1b bash benchmarks/gpu.sh            (http + long; parts end by DEADLINE_S, 570 s)
#   call 3 at once, the same with MODELS=8b.  PARTS=engine adds engine-level numbers (also in
#          benchmarks/batch_throughput.py, whose H200 numbers docs/benchmarks.md reports).
# Locally (CPU, a shape check of this script):  PYTHON=.venv/bin/python MODELS=tiny bash benchmarks/gpu.sh
#
# Knobs (environment): MODELS ("1b 8b" | "tiny"), PARTS ("http long"; add "engine"), BATCHES (1,8,32,64),
#   DECODE_TOKENS (256), CONCURRENCY (1,8,32,64), REQUESTS (16), OUTPUT_TOKENS (128), SYSTEM_WORDS (600:
#   about 2400 tokens with these models' small BPE), HTTP_LIMIT_S (330), LONG_PROMPT_WORDS (2500),
#   LONG_LIMIT_S (120), PROFILE_LIMIT_S (240), PROFILE_CONCURRENCY (8,64,256), PROFILE_ARGS (more serving_profile.py
#   flags, e.g. "--workloads serving,agents"), OPTIONS_LIMIT_S (300), OPTIONS_ARGS (more serve_vs_engine.py flags), KNOBS_ARGS (more cuda_graph_knobs.py flags, e.g. "--batches 16,32,64"), KVQUANT_LIMIT_S (150), KVQUANT_ARGS (more kv_quant.py flags; on a CPU:
#   "--context 1024 --batches 2,4 --steps 8"), ENGINE_LIMIT_S (200 per stack), DEADLINE_S (570: the script's end), ROUNDS, PYTHON,
#   SERVE_STACKS ("ours mlx_lm"; add ours-nocache for the prompt cache's own effect).
# Results go to $OUT (the device tool's folder) or ./bench-results: gpu-log.txt (every table),
# engine-<model>.json, http-<model>.json, http-<model>.png; at most 8 files, as the device tool returns.
set -uo pipefail  # not -e: a part that fails is reported, and the next part still runs
cd "$(dirname "$0")/.."
RESULTS=${OUT:-$PWD/bench-results}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu-log.txt"
exec > >(tee -a "$LOG") 2>&1
MODELS=${MODELS:-1b 8b}
PARTS=${PARTS:-http long}
BATCHES=${BATCHES:-1,8,32,64}
DECODE_TOKENS=${DECODE_TOKENS:-256}
CONCURRENCY=${CONCURRENCY:-1,8,32,64}
REQUESTS=${REQUESTS:-16}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
SYSTEM_WORDS=${SYSTEM_WORDS:-600}
HTTP_LIMIT_S=${HTTP_LIMIT_S:-330}
LONG_LIMIT_S=${LONG_LIMIT_S:-120}
ENGINE_LIMIT_S=${ENGINE_LIMIT_S:-200}  # per stack
# Every part is cut to end by this many seconds after the start: a device call may run 600 s at most.
DEADLINE_S=${DEADLINE_S:-570}
LONG_PROMPT_WORDS=${LONG_PROMPT_WORDS:-2500}  # about 8.5k tokens with these models' small BPE
MODEL_ROOT=${MODEL_ROOT:-/tmp/mlx-trio-gpu-models}
# The stacks the http part serves (`mlx-trio bench --serve`); add ours-nocache to measure the prompt cache.
SERVE_STACKS=${SERVE_STACKS:-ours mlx_lm}
SERVE_FLAGS=$(for s in $SERVE_STACKS; do printf -- '--serve %s ' "$s"; done)

# The staged CUDA wheels are for the device (Python 3.12); elsewhere, PYTHON must already have mlx.
if [ -d .mlxcuda2 ] && nvidia-smi -L >/dev/null 2>&1; then
  . .mlxcuda2/activate.sh || { echo "gpu.sh: installing MLX CUDA failed (was call 1 run on this machine?)"; exit 1; }
  PY=${PYTHON:-python3}
else
  PY=${PYTHON:-python3}
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# Single GPU: NCCL is unused, but keep NVLink multicast off as the workplace asks.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) mlx-trio benchmarks/gpu.sh MODELS='$MODELS' PARTS='$PARTS'"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY - <<'EOF'
import importlib.metadata as md, platform
import mlx.core as mx
found = []
for name in ("mlx", "mlx-cuda-13", "mlx-cpu", "mlx-lm"):
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print("python", platform.python_version(), "| device", mx.default_device(), "|", " ".join(found))
EOF

build_model() {  # build_model SHAPE DIR: random bf16 weights, a ChatML tokenizer padded to the shape's vocab
  $PY - "$1" "$2" <<'EOF'
import json, math, sys, time
from pathlib import Path
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_trio.testing.tiny_models import CHATML_TEMPLATE, EOS_TOKEN, train_tokenizer

SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B; "tiny" checks this script on a CPU
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
}
shape, out = sys.argv[1], Path(sys.argv[2])
if (out / "model.safetensors").exists():
    print(f"model {shape}: {out} exists"); sys.exit(0)
start = time.perf_counter()
out.mkdir(parents=True, exist_ok=True)
VOCAB = 128256
config = {"model_type": "llama", "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "max_position_embeddings": 131072, "torch_dtype": "bfloat16", **SHAPES[shape]}
# A real byte-level BPE (tiny corpus) whose vocabulary is padded with decodable filler tokens up to VOCAB,
# so random weights can emit any id and both servers still detokenize it.
tok = json.loads(train_tokenizer(512).to_str())
vocab = tok["model"]["vocab"]
for i in range(len(vocab), VOCAB):
    vocab[f"\u0120w{i}"] = i
(out / "tokenizer.json").write_text(json.dumps(tok))
eos_id = vocab[EOS_TOKEN]
(out / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": None, "eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>", "add_bos_token": False,
    "add_eos_token": False, "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": CHATML_TEMPLATE}))
(out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
(out / "config.json").write_text(json.dumps(config))
model = llama.Model(llama.ModelArgs.from_dict(config))
weights = {}
for i, (name, p) in enumerate(sorted(tree_flatten(model.parameters()))):
    key = mx.random.key(i)
    if "norm" in name:
        weights[name] = mx.ones(p.shape, dtype=mx.bfloat16)
    else:  # small init keeps bf16 activations finite through the layers
        weights[name] = (mx.random.normal(p.shape, key=key) * (0.5 / math.sqrt(p.shape[-1]))).astype(mx.bfloat16)
    mx.eval(weights[name])
mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
nbytes = sum(w.nbytes for w in weights.values())
print(f"model {shape}: {nbytes / 1e9:.2f} GB of bf16 weights in {out} ({time.perf_counter() - start:.0f} s)")
EOF
}

engine_side() {  # engine_side SIDE DIR JSON: one stack's engine-level decode numbers
  timeout -k 20 "$ENGINE_LIMIT_S" $PY - "$1" "$2" "$3" "$BATCHES" "$DECODE_TOKENS" <<'EOF'
import json, sys, time
import mlx.core as mx
from mlx.utils import tree_flatten

side, model_dir, out, batches, T = sys.argv[1], sys.argv[2], sys.argv[3], [int(b) for b in sys.argv[4].split(",")], int(sys.argv[5])
PROMPT_LEN = 32
prompts = [[10 + (7 * b + j) % 400 for j in range(PROMPT_LEN)] for b in range(max(batches))]
rows = []

if side == "mlx_lm":
    from mlx_lm import load, stream_generate
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors
    model, tok = load(model_dir)
    weights_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    procs = make_logits_processors(logit_bias={e: -100.0 for e in tok.eos_token_ids})
    for _ in stream_generate(model, tok, prompts[0], max_tokens=16, logits_processors=procs):
        pass
    last = None
    for last in stream_generate(model, tok, prompts[0], max_tokens=T, logits_processors=procs):
        pass
    rows.append({"stack": "mlx_lm", "lane": "stream_generate", "B": 1, "tok_s": last.generation_tps,
                 "tokens": last.generation_tokens})
    for B in batches:
        # stop_tokens=None: no row stops before max_tokens, so every row decodes T tokens.
        gen = BatchGenerator(model, max_tokens=T, completion_batch_size=B)
        gen.insert(prompts[:1], [8])
        while gen.next_generated():
            pass
        start = time.perf_counter()
        gen.insert(prompts[:B], [T] * B)
        n = 0
        while responses := gen.next_generated():
            n += len(responses)
        wall = time.perf_counter() - start
        gen.close()
        rows.append({"stack": "mlx_lm", "lane": "BatchGenerator", "B": B, "tok_s": n / wall, "tokens": n})
else:
    import trio
    from mlx_trio import open_engine
    from mlx_trio.events import Finished, TextDelta

    async def run_rows(engine, B: int) -> dict:
        """B concurrent requests of T tokens; B=1 reports the decode rate after the first token."""
        bias = {e: -100.0 for e in engine.model.eos_token_ids}
        firsts, ends, counts = [], [], []

        async def one(i: int) -> None:
            first = None
            async for event in engine.generate(prompts[i], max_tokens=T, logit_bias=bias):
                if isinstance(event, TextDelta) and first is None and event.token_ids:
                    first = time.perf_counter()
                elif isinstance(event, Finished):
                    ends.append(time.perf_counter())
                    counts.append(event.usage.completion_tokens)
            firsts.append(first)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(B):
                nursery.start_soon(one, i)
        if B == 1:  # as mlx-lm's generation_tps counts it
            return {"tok_s": (counts[0] - 1) / (ends[0] - firsts[0]), "tokens": counts[0]}
        return {"tok_s": sum(counts) / (max(ends) - start), "tokens": sum(counts)}

    async def lane(batch: int, Bs: list) -> tuple:
        async with open_engine(model_dir, batch=batch) as engine:
            bias = {e: -100.0 for e in engine.model.eos_token_ids}
            await engine.complete(prompts[0], max_tokens=16, logit_bias=bias)  # warm-up: compile, first allocations
            return engine.model.weights_bytes, [{"B": B, **await run_rows(engine, B)} for B in Bs]

    weights_bytes, alone = trio.run(lane, 1, [1])
    rows += [{"stack": "ours", "lane": "--batch 1 (one row)", **r} for r in alone]
    _, batched = trio.run(lane, max(batches), batches)
    rows += [{"stack": "ours", "lane": f"batch (--batch {max(batches)})", **r} for r in batched]
json.dump({"side": side, "weights_bytes": weights_bytes, "decode_tokens": T, "prompt_tokens": PROMPT_LEN,
           "device": str(mx.default_device()), "rows": rows}, open(out, "w"), indent=1)
for r in rows:
    print(f"{r['stack']:7s} {r['lane']:22s} B={r['B']:<3d} {r['tok_s']:9.1f} tok/s")
EOF
}

engine_table() {  # engine_table MODEL: join both sides into engine-<model>.json and print the table
  $PY - "$1" "$RESULTS/engine-$1.json" /tmp/engine-"$1"-mlx_lm.json /tmp/engine-"$1"-ours.json <<'EOF'
import json, sys
# H200 HBM3e: 4.8 TB/s by the datasheet; a device-to-device copy measured about 4.3 TB/s here (KINDS.md).
PEAK_BYTES_S = 4.8e12
model, out, *paths = sys.argv[1:]
sides = [json.load(open(p)) for p in paths]
weights = sides[0]["weights_bytes"]
rows = [r for s in sides for r in s["rows"]]
print(f"\n### engine, {model}: {weights / 1e9:.2f} GB bf16 weights, {sides[0]['prompt_tokens']}-token prompts, "
      f"{sides[0]['decode_tokens']} decode tokens, {sides[0]['device']}\n")
print("| B | stack | lane | tok/s | ours/mlx-lm | weight reads/s ÷ 4.8 TB/s |\n|---|---|---|---|---|---|")
# ours is compared with stream_generate at B=1 and with BatchGenerator above it.
theirs = {r["B"]: r["tok_s"] for r in rows
          if r["stack"] == "mlx_lm" and (r["lane"] == "stream_generate") == (r["B"] == 1)}
for r in sorted(rows, key=lambda r: (r["B"], r["stack"] != "mlx_lm")):
    ratio = f"{r['tok_s'] / theirs[r['B']]:.2f}×" if r["stack"] == "ours" and theirs.get(r["B"]) else ""
    # One decode step reads every weight once; at B rows a step yields B tokens.
    frac = r["tok_s"] / r["B"] * weights / PEAK_BYTES_S
    print(f"| {r['B']} | {r['stack']} | {r['lane']} | {r['tok_s']:.1f} | {ratio} | {frac:.1%} |")
json.dump({"model": model, "peak_bytes_s": PEAK_BYTES_S, "sides": sides}, open(out, "w"), indent=1)
EOF
}

budget() {  # budget LIMIT_S: LIMIT_S, or less so that the whole script ends by DEADLINE_S
  local left=$((DEADLINE_S - SECONDS))
  echo $((left < $1 ? left : $1))
}

enough() {  # enough NAME LIMIT_S: false (and a line saying so) when under a minute is left for a part
  [ "$2" -ge 60 ] || { echo "gpu.sh: skipping $1: ${2}s left before DEADLINE_S=$DEADLINE_S"; return 1; }
}

script_part() {  # script_part PART LIMIT_S TITLE CMD...: one benchmark script for model $m, cut at its limit
  local part=$1 lim title=$3
  lim=$(budget "$2")
  shift 3
  echo; echo "### $title (limit ${lim}s)"
  enough "$part $m" "$lim" && { timeout -k 20 "$lim" "$@" || echo "gpu.sh: $part part for $m ended with status $?"; }
}
bench_part() {  # bench_part PART LIMIT_S TITLE ARGS...: `mlx-trio bench ARGS` on model $m, cut at its limit
  # (on time-out the bench stops its servers by pid before exiting); on a failure, the servers' last log lines
  local part=$1 lim title=$3 logs="/tmp/bench-logs-$1-$m"
  lim=$(budget "$2")
  shift 3
  rm -rf "$logs"
  echo; echo "### $title (limit ${lim}s)"
  enough "$part $m" "$lim" && { timeout -k 20 "$lim" $PY -m mlx_trio.bench --model "$dir" --log-dir "$logs" "$@" \
    || { echo "gpu.sh: $part part for $m ended with status $?; server logs:"; tail -n 20 "$logs"/*.log; }; }
}

for m in $MODELS; do
  dir="$MODEL_ROOT/llama-$m"
  echo; echo "== model $m"
  build_model "$m" "$dir" || { echo "gpu.sh: building $m failed"; continue; }
  case " $PARTS " in *" engine "*)
    { lim=$(budget "$ENGINE_LIMIT_S"); enough "engine $m (mlx_lm)" "$lim" && ENGINE_LIMIT_S=$lim \
        engine_side mlx_lm "$dir" "/tmp/engine-$m-mlx_lm.json"; } \
      && { lim=$(budget "$ENGINE_LIMIT_S"); enough "engine $m (ours)" "$lim" && ENGINE_LIMIT_S=$lim \
        engine_side ours "$dir" "/tmp/engine-$m-ours.json"; } \
      && engine_table "$m" || echo "gpu.sh: engine part for $m failed or was cut short";;
  esac
  case " $PARTS " in *" http "*)
    rounds=${ROUNDS:-$([ "$m" = 8b ] && echo 1 || echo 2)}
    max_c=${CONCURRENCY##*,}
    bench_part http "$HTTP_LIMIT_S" "http, $m: agents workload" $SERVE_FLAGS \
      --workload agents --concurrency "$CONCURRENCY" --requests "$REQUESTS" --requests-per-stream 2 \
      --rounds "$rounds" --output-tokens "$OUTPUT_TOKENS" --system-words "$SYSTEM_WORDS" --task-words 48 \
      --followup-words 24 --rate 64 \
      --ours-args "--batch $max_c" --mlx-lm-args "--decode-concurrency $max_c" \
      --out "$RESULTS/http-$m.json" --plot "$RESULTS/http-$m.png"
  ;; esac
  case " $PARTS " in *" agentloop "*)
    bench_part agentloop "$HTTP_LIMIT_S" "http, $m: agent-loop workload, 8 agents, zero think time" \
      --serve ours --serve mlx_lm --workload agent-loop --concurrency 8 --requests 48 --rounds 1 \
      --system-words "$SYSTEM_WORDS" --task-words 48 --tool-result-words 300 --output-tokens 64 \
      --ours-args "--batch 8" --mlx-lm-args "--decode-concurrency 8" --out "$RESULTS/agentloop-$m.json"
  ;; esac
  case " $PARTS " in *" kvquant "*)
    script_part kvquant "${KVQUANT_LIMIT_S:-150}" "kv_quant, $m: quantized KV, admission and decode" \
      $PY benchmarks/kv_quant.py --model "$dir" --json "$RESULTS/kvquant-$m.json" ${KVQUANT_ARGS:-}
  ;; esac
  case " $PARTS " in *" speculative "*)
    script_part speculative "${SPEC_LIMIT_S:-150}" "speculative, $m: prompt lookup and scripted proposals, B=1/4/16" \
      $PY benchmarks/speculative.py --model "$dir" --batches "${SPEC_BATCHES:-1,4,16}" --file-tokens 2000 --tokens 256 \
      --json "$RESULTS/speculative-$m.json" ${SPEC_ARGS:-}
  ;; esac
  case " $PARTS " in *" spechttp "*)
    bench_part spechttp "${SPEC_HTTP_LIMIT_S:-240}" "http, $m: agents workload, both servers with --draft-model (the model itself)" \
      --serve ours --serve mlx_lm --workload agents --concurrency 1,4,16 --requests 16 --rounds 1 --output-tokens 128 \
      --system-words "$SYSTEM_WORDS" --task-words 48 --followup-words 24 \
      --ours-args "--batch 16 --draft-model $dir" --mlx-lm-args "--decode-concurrency 16 --draft-model $dir" \
      --out "$RESULTS/spechttp-$m.json"
  ;; esac
  case " $PARTS " in *" distributed "*)
    script_part distributed "${DIST_LIMIT_S:-150}" "distributed, $m: 2 ranks (${DIST_BACKEND:-nccl}) vs 1" \
      $PY benchmarks/distributed.py --model "$dir" --ranks 2 --backend "${DIST_BACKEND:-nccl}" --requests 8 \
      --tokens 128 --json "$RESULTS/distributed-$m.json"
  ;; esac
  case " $PARTS " in *" cudnn "*)
    # Each backend in a fresh process (its first round is the cold process), each target on a fresh engine
    # (a fresh lease thread: cuDNN's plans are per thread, so cudnn-prefill builds them again at its start).
    for backend in mlx cudnn-prefill; do
      lim=$([ $backend = mlx ] && echo "${CUDNN_STALL_MLX_LIMIT_S:-60}" || echo "${CUDNN_STALL_LIMIT_S:-95}")
      MLX_TRIO_ATTENTION_BACKEND=$backend script_part cudnn "$lim" \
        "stall profile, $m: MLX_TRIO_ATTENTION_BACKEND=$backend, 4 streams, 8.5k prompt, 3 rounds, 40 and 100 ms" \
        $PY benchmarks/stall_profile.py --model "$dir" --streams 4 --long-tokens 8500 --rounds 3 \
        --prefill-chunk-ms 40,100 --cudnn-warm-tokens "${CUDNN_WARM_TOKENS:-9216}" \
        --json "$RESULTS/cudnn-stall-$backend-$m.json" ${CUDNN_STALL_ARGS:-}
    done
    # The agent loop, ours-mlx-attention (MLX's kernels) vs ours (prefill-only cuDNN, plans built at start: the CUDA
    # default since the eleventh pass) vs mlx_lm.server.
    bench_part cudnn-agentloop "${CUDNN_AGENT_LIMIT_S:-85}" "agent loop, $m: ours-mlx-attention vs ours vs mlx_lm.server, 8 agents" \
      --serve ours-mlx-attention --serve ours --serve mlx_lm --workload agent-loop \
      --concurrency 8 --requests "${CUDNN_AGENT_REQUESTS:-24}" --rounds 1 --system-words "$SYSTEM_WORDS" \
      --task-words 48 --tool-result-words 300 --output-tokens 64 \
      --ours-args "--batch 8" --mlx-lm-args "--decode-concurrency 8" \
      --out "$RESULTS/cudnn-agentloop-$m.json" ${CUDNN_AGENT_ARGS:-}
  ;; esac
  case " $PARTS " in *" profile "*)
    script_part profile "${PROFILE_LIMIT_S:-240}" "serving profile, $m: serving workload at c=${PROFILE_CONCURRENCY:-8,64,256}" \
      $PY benchmarks/serving_profile.py --model "$dir" --concurrency "${PROFILE_CONCURRENCY:-8,64,256}" \
      --json "$RESULTS/profile-$m.json" ${PROFILE_ARGS:-}
  ;; esac
  case " $PARTS " in *" options "*)
    script_part options "${OPTIONS_LIMIT_S:-300}" "serve vs engine, $m: engine B=8/64 vs HTTP c=8/64 per option kind" \
      $PY benchmarks/serve_vs_engine.py --model "$dir" --json "$RESULTS/options-$m.json" ${OPTIONS_ARGS:-}
  ;; esac
  case " $PARTS " in *" long "*)
    bench_part long "$LONG_LIMIT_S" "http, $m: long-prompt workload, an ~8k-token prompt arrives while 4 streams decode" \
      --serve ours --serve mlx_lm --workload long-prompt --concurrency 4 --rounds 2 \
      --long-prompt-words "$LONG_PROMPT_WORDS" --long-output-tokens 1024 --output-tokens 16 \
      --ours-args "--batch 8" --mlx-lm-args "--decode-concurrency 8"
  ;; esac
  case " $PARTS " in *" longctx "*)
    # Issue #46's workload: heavy-tailed prompts (x LONGCTX_SCALE words; 0.3 gives a ~12k-token mean with these
    # models' BPE), a shared system prefix, follow-up turns, outputs 50-900; a rate sweep, each stack at its
    # default row cap (ours: --batch auto). Report: TTFT p50/p90/p99, prefill tok/s under load, the highest rate
    # with TTFT p90 <= 5 s, and each stack's start-up.
    bench_part longctx "${LONGCTX_LIMIT_S:-540}" "http, $m: long-context workload, rates ${LONGCTX_RATES:-1.5,3,6}" \
      $SERVE_FLAGS --workload long-context --length-scale "${LONGCTX_SCALE:-0.3}" --rates "${LONGCTX_RATES:-1.5,3,6}" \
      --requests "${LONGCTX_REQUESTS:-60}" --concurrency 512 --rounds 1 --timeout-s 120 \
      --out "$RESULTS/longctx-$m.json" ${LONGCTX_ARGS:-}
  ;; esac
  case " $PARTS " in *" prefillrate "*)
    script_part prefillrate "${PREFILLRATE_LIMIT_S:-150}" "prefill under load, $m: a lone ${PREFILLRATE_TOKENS:-12288}-token prompt vs beside --batch - 2 decoding rows" \
      $PY benchmarks/prefill_budget.py --model "$dir" --tokens "${PREFILLRATE_TOKENS:-12288}" --prompts 3 --step 2048 \
      --batches ${PREFILLRATE_BATCHES:-8 64}
  ;; esac
  case " $PARTS " in *" paged "*)
    script_part paged "${PAGED_LIMIT_S:-300}" "paged KV, $m: step B=8/64 equal rows, bytes per token, siblings ${PAGED_PREFIX:-12400}-token prefix, lone prefill" \
      $PY benchmarks/paged_kv.py --model "$dir" --parts "${PAGED_PARTS:-equal,memory,siblings,prefill}" --equal-batches 8,64 \
      --prefix "${PAGED_PREFIX:-12400}" --long "${PAGED_LONG:-30000}" --batch 16 ${PAGED_ARGS:-}
  ;; esac
  case " $PARTS " in *" ragged "*)
    script_part ragged "${RAGGED_LIMIT_S:-150}" "ragged decode attention, $m: kernel check, us per call, B=64 padded step" \
      $PY benchmarks/ragged_attention.py --model "$dir" --json "$RESULTS/ragged-$m.json" ${RAGGED_ARGS:-}
  ;; esac
  case " $PARTS " in *" knobs "*)
    script_part knobs "${KNOBS_LIMIT_S:-200}" "knobs, $m: ${KNOBS_SETTINGS:-fused,unfused}, 3 rounds alternated, B=8 token agreement" \
      $PY benchmarks/cuda_graph_knobs.py --model "$dir" --settings "${KNOBS_SETTINGS:-fused,unfused}" --rounds 3 \
      --json "$RESULTS/knobs-$m.json" ${KNOBS_ARGS:-}
  ;; esac
  case " $PARTS " in *" anatomy "*)
    script_part anatomy "${ANATOMY_LIMIT_S:-150}" "step anatomy, $m: build / launch / read per step, primitives per step graph" \
      $PY benchmarks/step_anatomy.py --model "$dir" --batches "${ANATOMY_BATCHES:-1,8,64}" ${ANATOMY_ARGS:-}
  ;; esac
  case " $PARTS " in *" cohorts "*)
    script_part cohorts "${COHORTS_LIMIT_S:-120}" "cohort shapes, $m: one cohort prefill job by rows, new vs seen shapes" \
      $PY benchmarks/cohort_shapes.py --model "$dir" --json "$RESULTS/cohorts-$m.json" ${COHORTS_ARGS:-}
  ;; esac
done
echo; echo "== done $(date -u +%Y-%m-%dT%H:%M:%SZ)"
