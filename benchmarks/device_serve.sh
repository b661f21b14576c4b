#!/usr/bin/env bash
# A served 1P+1D sharing the device's one GPU, then one colocated worker on it, each measured by `pdserve bench
# --server` with the same chat workload: run by benchmarks/device_check.sh after the GPU tests and the bench.
#
# What the device machine lacks travels in the ignored folder .devcarry (see device_check.sh): Ray (its wheel,
# 79 MB, is over a call's 64 MiB, so it travels as a tar.xz of the package without its Java jars, dashboard
# front end, RLlib, Data, Train, Tune and LLM libraries), the small wheels pdserve needs, and SmolLM2's tokenizer
# and config (its GGUF, 98 MB, cannot travel: the weights are random, of SmolLM2's shape; speed does not depend
# on their values).
set -uo pipefail
out=${OUT:-/tmp/device_check}
model=/tmp/smollm2-random
python3 - "$model" <<'PY' 2>&1 | tee "$out/serve_model.log"
import sys
from pathlib import Path
from transformers import AutoTokenizer
from benchmarks.cuda_bench import SMOLLM2_SHAPE
from engine.checkpoint import random_state_dict, write_checkpoint
write_checkpoint(Path(sys.argv[1]), SMOLLM2_SHAPE, random_state_dict(SMOLLM2_SHAPE, seed=0),
                 AutoTokenizer.from_pretrained(".devcarry/tok"))
print("wrote", sys.argv[1])
PY

serve_and_bench() {  # NAME SERVE-FLAGS...
  local name=$1; shift
  local port=50061
  python3 -m control.cli serve --model "$model" --port $port --http-port 0 --metrics-port off "$@" \
    >"$out/serve_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 60); do
    python3 -m control.cli workers --server 127.0.0.1:$port >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || { echo "$name: serve exited"; tail -20 "$out/serve_$name.log"; return 1; }
    sleep 1
  done
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$out/gpu_apps_$name.txt"
  timeout 100 python3 -m control.cli bench --server 127.0.0.1:$port --workload chat --concurrency 16 \
    --num-requests 96 --warmup 2 --rounds 1 --no-progress --title "$name on one H200" --out "$out/bench_$name" \
    2>&1 | tail -25 | tee "$out/bench_$name.txt"
  kill -TERM $pid; wait $pid
}
serve_and_bench 1p1d --prefill-resources '{"CPU": 1, "GPU": 0.5}' --decode-resources '{"CPU": 1, "GPU": 0.5}'
serve_and_bench 1c --colocated-workers 1 --prefill-workers 0 --decode-workers 0 \
  --decode-resources '{"CPU": 1, "GPU": 1}'
