#!/bin/bash
# The real side of the planner's accuracy table (docs/planner.md): each layout/workload at two rates,
# one layout at a time (--rounds 1), so every run sees the exact trace `pdserve plan simulate` replays.
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-benchmarks/results/planner}; mkdir -p "$OUT"  # where the runs go (default: the 2026-12-03 set)
COMMON="--rounds 1 --seed 0 --warmup 2 --no-progress"
pdserve bench --launch 1p1d 2c --workload chat --rate 0.5 --num-requests 40 $COMMON --out $OUT/acc-chat-r0p5
pdserve bench --launch 1p1d 2c --workload chat --rate 1.0 --num-requests 40 $COMMON --out $OUT/acc-chat-r1p0
pdserve bench --launch 2p1d --workload rag --rate 0.15 --num-requests 20 $COMMON --out $OUT/acc-rag-r0p15
pdserve bench --launch 2p1d --workload rag --rate 0.3 --num-requests 20 $COMMON --out $OUT/acc-rag-r0p3
pdserve bench --launch 1p2d --workload burst --rate 0.3 --num-requests 32 $COMMON --out $OUT/acc-burst-r0p3
pdserve bench --launch 1p2d --workload burst --rate 0.6 --num-requests 32 $COMMON --out $OUT/acc-burst-r0p6
