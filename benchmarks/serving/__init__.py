"""`pdserve bench`: side-by-side serving runs over the gRPC API (issue #7).

One concept per file, in the order a run uses them:

- `workloads`: request shapes named after real traffic (`chat`, `rag`, `agent`, `burst`, a JSONL file),
  prompts as token ids drawn from a seed;
- `load`: open loop (Poisson arrivals at a rate) or closed loop (a fixed concurrency), bounded in count and
  time;
- `client`: drives one load against a server over gRPC and records every message's arrival time;
- `stats`: percentiles, SLO attainment, throughput from those records;
- `goodput`: the short rate search for the highest rate that still meets the SLOs;
- `launch`: server layouts (`1p1d`, `2c`, `2p1d:round-robin`) started in this process on one Ray cluster;
- `report`: the terminal table, the JSON file and the figure;
- `cli`: `pdserve bench ...`, which ties them together.
"""
