#!/bin/bash
# The real side of the planner's accuracy table (docs/planner.md): each layout/workload at two rates,
# one layout at a time (--rounds 1), so every run sees the exact trace `pdserve plan simulate` replays.
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-benchmarks/results/planner}; mkdir -p "$OUT"  # where the runs go (default: the 2026-12-03 set)
if [ "${PROFILE:-}" = new ]; then  # the day's profile, right before the runs (this VM drifts by 20% in hours)
  pdserve plan profile --launch --out "$OUT/profile-smollm2-cpu.json" > "$OUT/profile.log" 2>&1
fi
COMMON="--rounds 1 --seed 0 --warmup 2 --no-progress --memory-probe"
# NOTE: one layout per bench process: a launched layout's idle workers slow the one measured beside them
# (docs/planner.md, "idle layouts slow the measured one"); the runs before 2026-12-06 launched 1p1d and 2c
# together
for rate in 0.5 1.0; do
  for layout in 1p1d 2c; do
    pdserve bench --launch $layout --workload chat --rate $rate --num-requests 40 $COMMON \
      --out $OUT/acc-chat-r${rate/./p}-$layout
  done
done
pdserve bench --launch 2p1d --workload rag --rate 0.15 --num-requests 20 $COMMON --out $OUT/acc-rag-r0p15
pdserve bench --launch 2p1d --workload rag --rate 0.3 --num-requests 20 $COMMON --out $OUT/acc-rag-r0p3
pdserve bench --launch 1p2d --workload burst --rate 0.3 --num-requests 32 $COMMON --out $OUT/acc-burst-r0p3
pdserve bench --launch 1p2d --workload burst --rate 0.6 --num-requests 32 $COMMON --out $OUT/acc-burst-r0p6
