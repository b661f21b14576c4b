#!/usr/bin/env bash
# `vllm serve` against pdserve's built-in engine, colocated (one worker, 2 threads) and 1P+1D (1 thread each),
# on the same SmolLM2-135M weights (vLLM: the float32 HF directory; pdserve: its default, the GGUF blocks
# those float32 values come from, or with QUANTIZATION=none the HF directory's float32 matrices), the same
# OpenAI requests, concurrency 8 then 1 on each server in turn: benchmarks/vllm_side_by_side.sh with
# ENGINE=builtin. Needs the [vllm] install (docs/vllm_backend.md) for `vllm serve`.
#
#   bash benchmarks/builtin_vs_vllm_serve.sh OUT_DIR [WORKLOAD.jsonl] [CONCURRENCIES] [NUM_REQUESTS]
set -euo pipefail
ENGINE=builtin exec bash "$(dirname "$0")/vllm_side_by_side.sh" "${1:?OUT_DIR}" \
  "${2:-benchmarks/workloads/long-prompts.jsonl}" "${3:-8 1}" "${4:-24}"
