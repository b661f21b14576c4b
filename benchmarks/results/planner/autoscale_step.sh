#!/bin/bash
# The autoscaler under a rate step (docs/planner.md): a 1p1d deployment, `pdserve plan watch --apply`,
# chat load at 0.3 -> 1.5 -> 0.3 req/s (pdserve bench --server, one run per level).
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/planner/autoscale-step
P=benchmarks/results/planner/profile-smollm2-cpu.json
echo '{"ttft_s": 1.0, "itl_s": 0.07, "target": 0.9}' > $OUT/slo.json
# NOTE: half a Ray CPU slot a worker: the cluster serve starts has a slot a core (2), and a third worker
# would wait for one forever
pdserve serve --prefill-workers 1 --decode-workers 1 --port 50391 --metrics-port 9491 --http-port 0 \
  --max-pool-size 2 --prefill-resources '{"CPU": 0.5}' --decode-resources '{"CPU": 0.5}' > $OUT/serve.log 2>&1 &
SERVE=$!
# the gRPC door opens before the workers are ready: wait for both
for _ in $(seq 150); do grep -q "ready on node .* (2/2)" $OUT/serve.log && break; sleep 2; done
pdserve plan watch --server 127.0.0.1:50391 --metrics http://127.0.0.1:9491/metrics --profile $P \
  --slo-file $OUT/slo.json --interval 15 --cooldown 30 --down-after 2 --max-pool-size 2 --apply --rounds 20 \
  > $OUT/watch.log 2>&1 &
WATCH=$!
B="pdserve bench --server 127.0.0.1:50391 --workload chat --rounds 1 --warmup 0 --no-progress --ttft-slo 1 --itl-slo 0.07"
$B --rate 0.3 --num-requests 14 --duration 45 --seed 1 --out $OUT/low-1 > $OUT/bench-low-1.log 2>&1
$B --rate 1.5 --num-requests 110 --duration 75 --seed 2 --out $OUT/high > $OUT/bench-high.log 2>&1
$B --rate 0.3 --num-requests 27 --duration 90 --seed 3 --out $OUT/low-2 > $OUT/bench-low-2.log 2>&1
wait $WATCH
pdserve workers --server 127.0.0.1:50391 > $OUT/workers-end.txt 2>&1
kill -TERM $SERVE; wait $SERVE
echo DONE
