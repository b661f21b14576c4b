#!/bin/bash
# "The plan is right" (docs/planner.md): one chat trace, two SLOs. `plan size --as-profiled` picks a layout
# for each from the day's profile (this machine: every worker shares its 2 cores); then the picks and their
# neighbours run for real on the same trace, one layout at a time.
#   run 1 (14:10): benchmarks/results/planner/plan_right.sh   (1 req/s; SLOs 1 s/100 ms and 0.6 s/100 ms)
#   run 2: RATE=0.6 SLOS="1.0/0.1 1.0/0.075" LAYOUTS="1c 1p1d 2c" PROFILE=.../2026-12-05-eve/... plan_right.sh OUT
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-benchmarks/results/planner/plan-right-2026-12-05}; mkdir -p "$OUT"
P=${PROFILE:-benchmarks/results/planner/2026-12-05-pm/profile-smollm2-cpu.json}
RATE=${RATE:-1.0}
TRACE="--workload chat --rate $RATE --num-requests 60 --seed 0"
for slo in ${SLOS:-1.0/0.1 0.6/0.1}; do
  ttft=${slo%/*}; itl=${slo#*/}
  pdserve plan size --profile $P $TRACE --ttft-slo $ttft --itl-slo $itl --as-profiled --max-pool-size 3 \
    --json $OUT/plan-ttft$ttft-itl$itl.json | tee $OUT/plan-ttft$ttft-itl$itl.txt || true
done
# one thread a worker, as the profile was taken (a lone colocated worker would otherwise take both cores)
pdserve bench --launch ${LAYOUTS:-1c 1p1d 2c 2p1d} $TRACE --rounds 1 --warmup 2 --no-progress --worker-threads 1 \
  --ttft-slo 1.0 --itl-slo 0.1 --out $OUT/runs
