#!/bin/bash
# The autoscaler under a rate step that fits this machine (docs/planner.md): a 1p1d deployment whose decode
# workers hold NUM_BLOCKS KV blocks each (192: 3,072 tokens, about 7 of the trace's streams), so a second
# decode worker doubles the streams the pool holds even on 2 shared cores; long chat answers (96-224 prompt
# tokens, 192-320 out) at LOW -> HIGH -> LOW req/s, the three phases overlapping as one open-loop arrival
# stream; `pdserve serve --autoscale --autoscale-as-profiled` sizes from the day's profile with the
# deployment's engine settings (its blocks) and scales through its own pools, draining with KV moves.
#   run 1 (2026-12-05 15:15): NUM_BLOCKS=128 LOW=0.1 HIGH=0.35 INTERVAL=10
#   run 2: the defaults
#   run 3 (2026-12-06): PROFILE=benchmarks/results/planner/plan-right-2026-12-06/profile-smollm2-cpu.json
#     MARGIN=0.15 HIGH=0.3 (the SLO file's "margin": size against both bounds less 15%)
#   run 4: the same with MARGIN=0.3
#   run 5 (2026-12-06 evening): PROFILE=new MARGIN=0.3 HIGH=0.3, after `sizes_to_ask` (no pool shrinks while
#     no layout meets the SLO) and the rate window (`RateWindow`: at least 8 requests a reading)
cd "$(dirname "$0")/../../.."
OUT=${1:-benchmarks/results/planner/autoscale-kv-step}; mkdir -p "$OUT"
P=${PROFILE:-benchmarks/results/planner/2026-12-05-eve/profile-smollm2-cpu.json}
if [ "$P" = new ]; then  # a profile taken right before the run: this VM drifts by 20% within a morning
  P=$OUT/profile-smollm2-cpu.json
  pdserve plan profile --launch --worker-threads 1 --out "$P" > $OUT/profile.log 2>&1
fi
NUM_BLOCKS=${NUM_BLOCKS:-192}; LOW=${LOW:-0.1}; HIGH=${HIGH:-0.45}; INTERVAL=${INTERVAL:-15}
echo "{\"ttft_s\": 1.5, \"itl_s\": 0.12, \"target\": 0.9, \"margin\": ${MARGIN:-0}}" > $OUT/slo.json
# NOTE: half a Ray CPU slot a worker: the cluster serve starts has a slot a core (2), and a third and fourth
# worker would wait for one forever
pdserve serve --prefill-workers 1 --decode-workers 1 --port 50391 --metrics-port 9491 --http-port 0 \
  --max-pool-size 2 --num-blocks $NUM_BLOCKS --worker-threads 1 --prefill-resources '{"CPU": 0.5}' \
  --decode-resources '{"CPU": 0.5}' --autoscale $OUT/slo.json --autoscale-profile $P --autoscale-as-profiled \
  --autoscale-interval $INTERVAL --autoscale-cooldown 30 --autoscale-down-after 2 > $OUT/serve.log 2>&1 &
SERVE=$!
for _ in $(seq 150); do grep -q "ready on node .* (2/2)" $OUT/serve.log && break; sleep 2; done
B="pdserve bench --server 127.0.0.1:50391 --workload benchmarks/workloads/long-chat.jsonl --rounds 1 --warmup 0
   --no-progress --ttft-slo 1.5 --itl-slo 0.12"
$B --rate $LOW --num-requests 40 --duration 60 --seed 1 --out $OUT/low-1 > $OUT/bench-low-1.log 2>&1 &
LOW1=$!
sleep 60
$B --rate $HIGH --num-requests 200 --duration 300 --seed 2 --out $OUT/high > $OUT/bench-high.log 2>&1 &
HIGH_PID=$!
sleep 300
$B --rate $LOW --num-requests 40 --duration 180 --seed 3 --out $OUT/low-2 > $OUT/bench-low-2.log 2>&1
wait $LOW1 $HIGH_PID
sleep 30  # a last interval or two: the pools back at 1p1d
curl -s http://127.0.0.1:9491/metrics | grep -E "^pdserve_(planner|kv_moved|request_migrations|pool)" > $OUT/metrics-end.txt
pdserve workers --server 127.0.0.1:50391 > $OUT/workers-end.txt 2>&1
kill -TERM $SERVE; wait $SERVE
python3 - "$OUT" <<'PY'
import json, sys
runs = [json.load(open(f"{sys.argv[1]}/{p}.json"))["runs"][0]["summary"] for p in ("low-1", "high", "low-2")]
sent = sum(r["num_sent"] for r in runs)
failed = sum(r["num_sent"] - r["num_completed"] for r in runs)
met = sum(r["slo_attainment"] * r["num_completed"] for r in runs)
print(f"requests {sent}, failed {failed}, SLO attainment over the run {met / sent:.1%}")
PY
echo DONE
