"""How much of each decode worker's KV cache sits reserved for prompts that are still queued or prefilling
elsewhere: samples a running deployment's /metrics while a load runs (issue #15).

    pdserve serve --prefill-workers 2 --decode-workers 1 --port 50371 --metrics-port 9471 &
    python -m benchmarks.kv_reserved_probe --metrics http://127.0.0.1:9471/metrics --duration 120 &
    pdserve bench --server 127.0.0.1:50371 --workload burst --concurrency 8 --num-requests 48

Every `--interval` it reads `pdserve_kv_cache_usage_ratio` and `pdserve_kv_reserved_ratio` of the decode
pool; at the end it reports, per decode worker, over the samples in which it held anything: the mean share
of its blocks in use, the mean share reserved and awaiting KV, and the reserved part of what is in use
(mean and p90 of reserved / used).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

NAMES = ("pdserve_kv_cache_usage_ratio", "pdserve_kv_reserved_ratio")


def sample(url: str) -> dict[str, dict[str, float]]:
    """{decode worker: {metric name: value}} from one scrape."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in NAMES and s.labels.get("pool") == "decode":
                out[s.labels["worker"]][s.name] = s.value
    return out


def summarize(samples: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    per_worker: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for snap in samples:
        for worker, v in snap.items():
            used, reserved = v.get(NAMES[0], 0.0), v.get(NAMES[1], 0.0)
            if used > 0:
                per_worker[worker].append((used, reserved))
    result = {}
    for worker, rows in per_worker.items():
        share = sorted(r / u for u, r in rows)
        result[worker] = {"samples": len(rows), "used": statistics.fmean(u for u, _ in rows),
                          "reserved": statistics.fmean(r for _, r in rows),
                          "reserved_of_used": statistics.fmean(share),
                          "reserved_of_used_p90": share[int(0.9 * (len(share) - 1))]}
    return result


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--metrics", required=True, help="the deployment's /metrics URL")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds to sample for")
    ap.add_argument("--interval", type=float, default=0.25)
    args = ap.parse_args(argv)
    samples = []
    end = time.monotonic() + args.duration
    while time.monotonic() < end:
        samples.append(sample(args.metrics))
        time.sleep(args.interval)
    print(json.dumps(summarize(samples), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
