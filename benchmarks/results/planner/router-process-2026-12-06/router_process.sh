#!/bin/bash
# router in the bench's process (--launch) vs in a process of its own (pdserve serve + --server), 1p1d, chat 1 req/s
OUT=${OUT:-/tmp/router-process}; mkdir -p "$OUT"
cd "$(git rev-parse --show-toplevel)" && . .venv/bin/activate
W="--workload chat --rate 1 --num-requests 60 --seed 7 --no-progress"
pdserve bench --launch 1p1d $W --out $OUT/A1 > $OUT/A1.log 2>&1
pdserve serve --model smollm2-135m --prefill-workers 1 --decode-workers 1 --worker-threads 1 --max-num-seqs 64 \
  --port 50071 --http-port 0 --metrics-port 0 > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 180); do grep -q "serving smollm2-135m on" $OUT/serve.log && break; sleep 1; done
pdserve bench --server 127.0.0.1:50071 $W --out $OUT/B1 > $OUT/B1.log 2>&1
kill -INT $SP; wait $SP
pdserve bench --launch 1p1d $W --out $OUT/A2 > $OUT/A2.log 2>&1
echo done > $OUT/done
