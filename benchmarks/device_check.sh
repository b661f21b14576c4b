#!/usr/bin/env bash
# The one prepared run for a session lent a GPU machine (the `device` tool, 15 minutes in all): the GPU tests
# and the CUDA decode bench, each under its own timeout, logs under $OUT. The machine's image has torch,
# transformers, safetensors and pytest, and no Ray: nothing here needs it (a served 1P+1D needs Ray, whose
# wheel is over what a call carries, and the SmolLM2 GGUF is too: the bench uses a random model of its shape).
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=540)
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "device", torch.cuda.get_device_name())'
} 2>&1 | tee "$out/env.txt"
# the GPU tests: the engine against transformers on CUDA (fp32 and bf16), speculation on CUDA, the KV
# transfer's CUDA path (side-stream packing; NCCL needs two GPUs and says so)
timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -q tests/engine/test_engine_cuda.py \
  tests/kv_transfer/test_kvx_gpu.py 2>&1 | tee "$out/pytest_gpu.log"
timeout 200 python3 -m benchmarks.cuda_bench --json --out "$out/cuda_bench.json" 2>&1 | tee "$out/cuda_bench.log"
# `--engine vllm` 1P+1D sharing the GPU (NCCL between the two engines), when the image has vLLM and Ray (the
# machines lent so far had neither, and nothing outside them can be reached to install them)
if python3 -c 'import vllm, ray' 2>/dev/null; then
  timeout 300 python3 -m pytest -m slow -p no:cacheprovider -q -x tests/serving/test_vllm_engine.py \
    -k "grpc or http" 2>&1 | tee "$out/vllm_1p1d.log"
else
  echo "skipped: this machine has no vllm or ray" | tee "$out/vllm_1p1d.log"
fi
