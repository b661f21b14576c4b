#!/bin/bash
# The autoscaler under a rate step (docs/planner.md): a 1p1d deployment, `pdserve plan watch --apply`,
# chat load at 0.3 -> 1.5 -> 0.3 req/s (pdserve bench --server, one run per level).
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/planner/autoscale-step
P=benchmarks/results/planner/profile-smollm2-cpu.json
echo '{"ttft_s": 1.0, "itl_s": 0.07, "target": 0.9}' > $OUT/slo.json
pdserve serve --prefill-workers 1 --decode-workers 1 --port 50391 --metrics-port 9491 --http-port 0 \
  --max-pool-size 2 > $OUT/serve.log 2>&1 &
SERVE=$!
for _ in $(seq 120); do grep -q "serving smollm2" $OUT/serve.log && break; sleep 2; done
pdserve plan watch --server 127.0.0.1:50391 --metrics http://127.0.0.1:9491/metrics --profile $P \
  --slo-file $OUT/slo.json --interval 15 --cooldown 30 --down-after 2 --max-pool-size 2 --apply --rounds 22 \
  > $OUT/watch.log 2>&1 &
WATCH=$!
B="pdserve bench --server 127.0.0.1:50391 --workload chat --rounds 1 --warmup 0 --no-progress --ttft-slo 1 --itl-slo 0.07"
$B --rate 0.3 --num-requests 18 --duration 60 --seed 1 --out $OUT/low-1 > $OUT/bench-low-1.log 2>&1
$B --rate 1.5 --num-requests 135 --duration 90 --seed 2 --out $OUT/high > $OUT/bench-high.log 2>&1
$B --rate 0.3 --num-requests 27 --duration 90 --seed 3 --out $OUT/low-2 > $OUT/bench-low-2.log 2>&1
wait $WATCH
pdserve workers --server 127.0.0.1:50391 > $OUT/workers-end.txt 2>&1
kill -TERM $SERVE; wait $SERVE
echo DONE
