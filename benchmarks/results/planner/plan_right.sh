#!/bin/bash
# "The plan is right" (docs/planner.md): one trace (chat, 1 req/s, 60 requests), two SLOs. `plan size
# --as-profiled` picks a layout for each from the day's profile (this machine: every worker shares its 2
# cores); then the picks and their neighbours run for real on the same trace, one layout at a time.
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-benchmarks/results/planner/plan-right-2026-12-05}; mkdir -p "$OUT"
P=${PROFILE:-benchmarks/results/planner/2026-12-05-pm/profile-smollm2-cpu.json}
TRACE="--workload chat --rate 1.0 --num-requests 60 --seed 0"
for slo in "1.0 0.1" "0.6 0.1"; do
  set -- $slo
  pdserve plan size --profile $P $TRACE --ttft-slo $1 --itl-slo $2 --as-profiled --max-pool-size 3 \
    --json $OUT/plan-ttft$1-itl$2.json | tee $OUT/plan-ttft$1-itl$2.txt || true
done
# one thread a worker, as the profile was taken (a lone colocated worker would otherwise take both cores)
pdserve bench --launch 1c 1p1d 2c 2p1d $TRACE --rounds 1 --warmup 2 --no-progress --worker-threads 1 \
  --ttft-slo 1.0 --itl-slo 0.1 --out $OUT/runs
