#!/usr/bin/env bash
# The one prepared run for a session lent a GPU machine (the `device` tool, 15 minutes in all): the GPU tests,
# the CUDA decode bench, and a served 1P+1D sharing the GPU beside one colocated worker (device_serve.sh), each
# under its own timeout, logs under $OUT. The machine's image has torch, transformers, safetensors and pytest;
# Ray and pdserve's smaller dependencies travel in the ignored folder .devcarry, made here first with
# `bash benchmarks/device_carry.sh`.
#
#   run(command="bash benchmarks/device_check.sh", carry=[".devcarry"], timeout_s=590)
set -uo pipefail
export PYTHONUNBUFFERED=1 PDSERVE_KERNELS=0  # the CPU attention kernel: nothing here runs on the CPU
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
if [ -d .devcarry ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devcarry/*.whl && tar xJf .devcarry/ray-*-stripped.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "device", torch.cuda.get_device_name())'
} 2>&1 | tee "$out/env.txt"
# the GPU tests: the engine against transformers on CUDA (fp32 and bf16), speculation on CUDA, the KV
# transfer's CUDA path (side-stream packing; NCCL needs two GPUs and says so)
timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q tests/engine/test_engine_cuda.py \
  tests/kv_transfer/test_kvx_gpu.py 2>&1 | tee "$out/pytest_gpu.log"
timeout 120 python3 -m benchmarks.cuda_bench --json --out "$out/cuda_bench.json" 2>&1 | tee "$out/cuda_bench.log"
if python3 -c 'import ray' 2>/dev/null; then
  timeout 360 bash benchmarks/device_serve.sh
else
  echo "skipped the served 1P+1D: this machine has no ray (make .devcarry: benchmarks/device_carry.sh)"
fi
# `--engine vllm` 1P+1D (NCCL between two vLLM engines) needs vLLM's CUDA wheel, hundreds of MB: it cannot travel
python3 -c 'import vllm' 2>/dev/null || echo "skipped --engine vllm: this machine has no vllm" | tee "$out/vllm_1p1d.log"
