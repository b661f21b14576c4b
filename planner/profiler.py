"""`pdserve plan profile`: measure a deployment into a profile, through its own API, in a few minutes.

Against a 1-prefill + 1-decode deployment (started here with `--launch`, as `pdserve bench` does, or a
running one with `--server`), one sweep at a time, each request's prompt fresh random tokens (no cache hit
unless asked for):

1. prefill: one prompt at a time of 32-1,280 tokens; the server's own `timing.prefill_seconds` (first
   chunk to first token, engine time) fitted as steps x step_s + tokens x token_s + attention pairs x
   attention_s; then prompts whose prefix is cached (the same prefix again, a new tail) as a check of the
   attention term (the tail attends to the cached prefix);
2. the router: client TTFT less the server's queue + prefill, at idle;
3. KV transfer: `timing.kv_transfer_seconds` (what is left of the push after the last chunk) against the
   last chunk's bytes; and the router's own measured link rate, recorded beside it;
4. interference: a batch decoding while long prompts prefill, then while chat-sized ones do: how much two
   workers computing at once stretch each other's steps on this machine (memory bandwidth, caches), beyond
   sharing its cores; a short prefill, bound by the weights it reads, loses more than a long one;
5. decode: B requests at once (B = 1-32, short prompts; B = 2, 4 and 8 with long ones, each long prompt
   sent once before so its prefill is a cache hit and the batch decodes whole), the median client gap
   between tokens as the step at batch B and context B x (prompt + half the output), fitted as a line in
   batch and context; the router's CPU per token relayed (this process's CPU over the tokens: router
   and load generator both, so an upper bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from planner.fitting import fit_nonnegative, relative_errors
from planner.profile import (
    LONG_INTERFERENCE_TOKENS,
    DecodeCost,
    EngineSettings,
    PrefillCost,
    Profile,
    RouterCost,
    TransferCost,
    machine_info,
    utc_now,
)

PREFILL_LENGTHS = (32, 64, 128, 256, 384, 512, 768, 1024, 1280)
CACHED_CASES = ((512, 64), (1024, 64), (1024, 512))  # (prompt tokens, uncached tail)
# (batch, prompt tokens); prompts of LONG_PROMPT tokens or more are cached first (`Prober.cache`)
DECODE_BATCHES = ((1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (32, 32), (2, 768), (8, 768), (4, 1280))
DECODE_OUTPUT = 48
LONG_PROMPT = 512
# a long prompt prefilling beside a decoding batch, and a chat-sized one
INTERFERENCE_PROMPT, INTERFERENCE_BATCH = LONG_INTERFERENCE_TOKENS, 4
SHORT_INTERFERENCE_PROMPT = 128
REPEATS = 2


@dataclass(frozen=True)
class Sample:
    """One request's times, from the client and the server."""

    prompt_len: int
    cached: int
    ttft_s: float
    server_queue_s: float
    server_prefill_s: float
    kv_transfer_s: float
    gaps: tuple[float, ...]


def _log(msg: str) -> None:
    print(f"pdserve plan profile: {msg}", file=sys.stderr, flush=True)


class Prober:
    """Sends requests of given shapes to one deployment and records what it saw."""

    def __init__(self, stub, vocab_size: int) -> None:
        self.stub, self.rng = stub, random.Random("profile")
        self.low = min(100, vocab_size // 4)
        self.high = vocab_size

    def tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.low, self.high) for _ in range(n))

    async def one(self, prompt: tuple[int, ...], max_tokens: int) -> Sample:
        from benchmarks.serving.client import RequestRecord, send_one
        from benchmarks.serving.workloads import RequestSpec

        rec = RequestRecord(0, "profile", len(prompt), max_tokens)
        await send_one(self.stub, RequestSpec(prompt, max_tokens, "profile"), rec,
                       f"profile-{self.rng.getrandbits(48):x}", 600.0)
        if not rec.ok or rec.ttft is None:
            raise RuntimeError(f"a profiling request failed: {rec.error}")
        st = rec.stages
        return Sample(len(prompt), rec.cached_prompt_tokens, rec.ttft, st["queue"], st["prefill"],
                      st["kv_transfer"], tuple(rec.itls[1:]))

    async def cache(self, prompts: list[tuple[int, ...]]) -> None:
        """Each prompt sent alone, so a batch of them later has prefills that are cache hits, end together and
        let its steps decode the whole batch (long prompts prefilled in the batch end seconds apart: eight of
        768 tokens, 14 s, past the first ones' last tokens)."""
        for prompt in prompts:
            await self.one(prompt, 1)

    async def batch(self, prompts: list[tuple[int, ...]], max_tokens: int) -> list[Sample]:
        return list(await asyncio.gather(*(self.one(prompt, max_tokens) for prompt in prompts)))


def _chunks(n: int, cached: int, chunk: int) -> list[tuple[int, int]]:
    """(tokens, context before them) of each step computing a prompt of n tokens past `cached` ones."""
    out, done = [], cached
    while done < n:
        k = min(chunk, n - done)
        out.append((k, done))
        done += k
    return out


def prefill_features(n: int, cached: int, chunk: int) -> list[float]:
    """[steps, tokens, attention pairs] of computing the prompt: the columns `PrefillCost` prices."""
    cs = _chunks(n, cached, chunk)
    return [len(cs), sum(k for k, _ in cs), sum(k * (c + k / 2) for k, c in cs)]


async def measure(stub, vocab_size: int) -> tuple[dict, float]:
    """Every sweep; returns the raw samples and the CPU seconds this process spent per decoded token."""
    from benchmarks.serving.cpu import machine_speed

    probe = Prober(stub, vocab_size)
    # the machine's memory and compute speed now and at the end (None: a probe failed; off the event loop,
    # which runs the router when the deployment was launched here)
    speeds = [await asyncio.to_thread(machine_speed)]
    _log("warming up (2 requests)")
    for _ in range(2):
        await probe.one(probe.tokens(256), 4)
    prefill = []
    for i, n in enumerate(PREFILL_LENGTHS):
        for _ in range(REPEATS):
            prefill.append(await probe.one(probe.tokens(n), 2))
        _log(f"[prefill {i + 1}/{len(PREFILL_LENGTHS)}] {n} tokens: "
             f"{statistics.median(s.server_prefill_s for s in prefill[-REPEATS:]) * 1e3:.0f} ms")
    cached = []
    for n, tail in CACHED_CASES:
        prefix = probe.tokens(n - tail)
        await probe.one(prefix + probe.tokens(tail), 2)
        cached.append(await probe.one(prefix + probe.tokens(tail), 2))
        _log(f"[cached] {n} tokens, {cached[-1].cached} cached: {cached[-1].server_prefill_s * 1e3:.0f} ms")
    decode, cpu, tokens = [], 0.0, 0
    for i, (b, p) in enumerate(DECODE_BATCHES):
        prompts, long = [probe.tokens(p) for _ in range(b)], p >= LONG_PROMPT
        if long:
            await probe.cache(prompts)
        c0 = time.process_time()
        got = await probe.batch(prompts, DECODE_OUTPUT)
        cpu += time.process_time() - c0
        tokens += b * DECODE_OUTPUT
        gaps = [g for s in got for g in s.gaps]
        # NOTE: what happened, not what was asked: a prompt evicted meanwhile (a small cache) prefilled whole
        cached_first = long and all(s.cached >= p // 2 for s in got)
        if long and not cached_first:
            _log(f"batch {b} of {p}-token prompts: some missed the prefix cache (evicted?); the fit leaves "
                 "this sample out")
        decode.append({"batch": b, "prompt_len": p, "gap_p50_s": statistics.median(gaps),
                       "num_gaps": len(gaps), "cached_first": cached_first})
        _log(f"[decode {i + 1}/{len(DECODE_BATCHES)}] batch {b}, {p}-token prompts: step "
             f"{decode[-1]['gap_p50_s'] * 1e3:.1f} ms")
    interference = await measure_interference(probe, INTERFERENCE_PROMPT)
    short = await measure_interference(probe, SHORT_INTERFERENCE_PROMPT)
    speeds.append(await asyncio.to_thread(machine_speed))
    probed = [s for s in speeds if s is not None]
    ends = (f"{gb:.2f}, {gflop:.0f}" for gb, gflop in probed)
    _log(f"machine speed index (memory GB/s, compute GFLOP/s), start and end: {'; '.join(ends) or 'failed'}")
    samples = {"interference": interference, "short_interference": short,
               "memory_gbps": [m for m, _ in probed], "compute_gflops": [c for _, c in probed],
               "prefill": [s.__dict__ | {"gaps": None} for s in prefill],
               "cached": [s.__dict__ | {"gaps": None} for s in cached], "decode": decode}
    return samples, cpu / max(1, tokens)


async def measure_interference(probe: Prober, prompt_len: int) -> dict:
    """Decode steps while the prefill worker computes prompts of `prompt_len`, one after another, and those
    prompts' prefill while the decode worker steps: what two workers computing at once cost each other on
    this machine."""
    stop = asyncio.Event()
    prompts: list[Sample] = []

    async def prefill_load() -> None:
        while not stop.is_set():
            prompts.append(await probe.one(probe.tokens(prompt_len), 2))

    background = asyncio.ensure_future(prefill_load())
    await asyncio.sleep(0.5)  # the first long prompt is computing
    got = await probe.batch([probe.tokens(32) for _ in range(INTERFERENCE_BATCH)], DECODE_OUTPUT)
    stop.set()
    await background
    gaps = [g for s in got for g in s.gaps]
    out = {"batch": INTERFERENCE_BATCH, "gap_p50_s": statistics.median(gaps),
           "prompt_len": prompt_len, "prefill_s": [s.server_prefill_s for s in prompts]}
    _log(f"[interference] batch {INTERFERENCE_BATCH} step {out['gap_p50_s'] * 1e3:.1f} ms beside "
         f"{len(prompts)} prefills of {prompt_len} tokens")
    return out


def overlap_stretch(extra_s: float, overlap_s: float) -> float:
    """How much longer a step takes while another worker computes, from a long prefill that took `extra_s`
    longer than alone while a batch decoded beside it for `overlap_s` of it: at a stretch i, those seconds
    did the work of overlap / (1 + i), so extra = overlap * i / (1 + i). Capped at 1 (half speed).

    NOTE: the long prefill, not the batch's steps, measures it: it is one fitted number against one long
    measurement, where a decode step's stretch would be a ratio of two noisy medians of tens of
    milliseconds. Dividing the extra by the whole prefill, as this fit once did, took 1,280 tokens' 4.27 s
    against 3.84 alone as a stretch of 0.06 where the 2.2 s of overlap say 0.24."""
    if extra_s <= 0 or overlap_s <= 0:
        return 0.0
    return min(1.0, extra_s / max(overlap_s - extra_s, 1e-9))


def decoded_whole(sample: dict) -> bool:
    """Whether a decode sample's gaps are its batch's steps. Profiles before 2026-12-06 22:45 prefilled long
    prompts inside the batch: two of 768 tokens end their prefills about when the first one's output is half
    done, but eight end 14 s apart, so that sample's gaps were mostly smaller batches beside a prefill (it
    read 89 ms where the batch takes about 125: it hid the context's cost, 46 kB of KV a token read every
    step, from the fit). Those are left out of the fit."""
    return sample.get("cached_first", False) or sample["prompt_len"] < LONG_PROMPT or sample["batch"] <= 2


def fit_profile(samples: dict, engine: EngineSettings, bytes_per_token: int, model: str,
                cpu_per_token_s: float, router_link_bytes_per_s: float | None, shared_cores: int | None) -> Profile:
    """The profile's constants from the sweeps' samples (module docstring)."""
    chunk = engine.prefill_chunk_tokens
    pre = samples["prefill"]
    rows = [prefill_features(s["prompt_len"], 0, chunk) for s in pre]
    step_s, token_s, attention_s = fit_nonnegative(rows, [s["server_prefill_s"] for s in pre])
    prefill = PrefillCost(step_s, max(token_s, 1e-9), attention_s)

    def fitted(prompt_len: int, cached: int = 0) -> float:
        """A prefill's seconds by the fit (before the token term's floor: what the samples are checked by)."""
        return sum(c * f for c, f in zip((step_s, token_s, attention_s),
                                         prefill_features(prompt_len, cached, chunk)))

    router_s = statistics.median(s["ttft_s"] - s["server_queue_s"] - s["server_prefill_s"] for s in pre)
    # the push left after the last chunk: that chunk's KV
    last = [(_chunks(s["prompt_len"], 0, chunk)[-1][0] * bytes_per_token, s["kv_transfer_s"]) for s in pre]
    latency, s_per_byte = fit_nonnegative([[1.0, b] for b, _ in last], [t for _, t in last])
    # NOTE: the push is layer-wise, within the step that computes a chunk: what is left after the last chunk
    # does not grow with its bytes on a fast link; the rate is then the one the slowest sample allows. (The
    # router's own link rate is bytes over the whole push, overlapped compute included: recorded, not used)
    # (every push done within its last chunk's step, as a small model's can be: at most 1 us left)
    link = 1 / s_per_byte if s_per_byte > 0 else max(b for b, _ in last) / max(1e-6, *(t for _, t in last))
    dec = [d for d in samples["decode"] if decoded_whole(d)]
    drows = [[1.0, d["batch"], d["batch"] * (d["prompt_len"] + DECODE_OUTPUT / 2)] for d in dec]
    d0, d_seq, d_ctx = fit_nonnegative(drows, [d["gap_p50_s"] for d in dec])
    decode = DecodeCost(d0, d_seq, d_ctx)
    inter = samples.get("interference")
    interference = 0.0
    if inter and inter["prefill_s"]:
        interference = overlap_stretch(statistics.median(inter["prefill_s"]) - fitted(inter["prompt_len"]),
                                       (DECODE_OUTPUT - 1) * inter["gap_p50_s"])
    short = samples.get("short_interference")
    short_interference = None
    if short and short["prefill_s"]:
        # a short prefill runs whole beside the batch: all of it overlaps
        took = statistics.median(short["prefill_s"])
        short_interference = (short["prompt_len"], overlap_stretch(took - fitted(short["prompt_len"]), took))
    p = Profile(model, machine_info(), utc_now(), prefill, decode,
                TransferCost(bytes_per_token, link, latency), RouterCost(max(0.0, router_s), cpu_per_token_s),
                engine, shared_cores, interference=interference, short_interference=short_interference)
    checks = {
        "prefill_fit_error_median": statistics.median(relative_errors(
            [fitted(s["prompt_len"]) for s in pre], [s["server_prefill_s"] for s in pre])),
        "cached_prefill_error": relative_errors(
            [fitted(s["prompt_len"], s["cached"]) for s in samples["cached"]],
            [s["server_prefill_s"] for s in samples["cached"]]),
        "decode_fit_error_median": statistics.median(relative_errors(
            [p.decode.step(int(r[1]), int(r[2])) for r in drows], [d["gap_p50_s"] for d in dec])),
        "kv_transfer_fitted_bytes_per_s": 1 / s_per_byte if s_per_byte > 0 else None,
        "router_link_bytes_per_s": router_link_bytes_per_s,
    }
    return Profile(**(p.__dict__ | {"samples": samples | {"checks": checks}}))


def refit(old: Profile, name: str) -> Profile:
    """`old`'s constants fitted again from its stored samples by this version's `fit_profile`; where and when
    it was measured, and the settings it was measured with, are kept."""
    samples = {k: v for k, v in old.samples.items() if k != "checks"}
    if not samples.get("prefill") or not samples.get("decode"):
        raise ValueError(f"{name}: holds no samples to fit again (a scaled or hand-written profile)")
    link = old.samples.get("checks", {}).get("router_link_bytes_per_s")
    new = fit_profile(samples, old.engine, old.transfer.bytes_per_token, old.model, old.router.token_s, link,
                      int(old.shared_cores) if old.shared_cores else None)
    return dataclasses.replace(new, machine=old.machine, date=old.date,
                               source=f"{old.source}, fitted again from its samples ({name})")


@contextlib.asynccontextmanager
async def _channel(address: str) -> AsyncIterator[object]:
    from router.security import ClientSecurity

    async with ClientSecurity().aio_channel(address) as channel:
        yield channel


async def profile_server(address: str, engine: EngineSettings, bytes_per_token: int | None,
                         shared_cores: int | None, cost=None) -> Profile:
    """Profile the deployment at `address` (1 prefill + 1 decode worker). `cost`: its router's live cost
    model when it runs in this process (its measured link rate and KV bytes per token)."""
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    async with _channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        kinds = {pool.kind: len(pool.workers) for pool in info.pools}
        if kinds.get(pb.POOL_KIND_PREFILL) != 1 or kinds.get(pb.POOL_KIND_DECODE) != 1:
            raise ValueError(f"profile a 1-prefill + 1-decode deployment; {address} has {dict(kinds)}")
        engine = EngineSettings(**(engine.__dict__ | {"block_size": info.block_size}))
        samples, cpu_per_token = await measure(stub, info.vocab_size)
    bpt = cost.bytes_per_token if cost is not None and cost.bytes_per_token else bytes_per_token
    if not bpt:
        raise ValueError("the KV bytes a token takes are unknown: pass --kv-bytes-per-token")
    links = list(cost.measured().link_bytes_per_s.values()) if cost is not None else []
    return fit_profile(samples, engine, bpt, info.model_name, cpu_per_token, links[0] if links else None,
                       shared_cores)


def profile_launched(model: str, engine: EngineSettings, shared_cores: int | None, worker_threads: int = 1,
                     num_blocks: int | None = None, bytes_per_token: int | None = None) -> Profile:
    """Start a 1p1d deployment here (as `pdserve bench --launch 1p1d`), profile it, stop it."""
    from benchmarks.serving.launch import Layout, LocalDeployment, start_ray

    layout = Layout.parse("1p1d")
    config = layout.serve_config(model=model, port=0, metrics_port=None, worker_threads=worker_threads,
                                 num_blocks=num_blocks, max_num_seqs=engine.max_num_seqs,
                                 max_num_batched_tokens=engine.max_num_batched_tokens,
                                 prefill_chunk_tokens=engine.prefill_chunk_tokens)
    _log(f"starting {layout.description} ({model})")
    start_ray([layout])
    with LocalDeployment(config) as dep:
        cost = dep.server.router.cost if dep.server.router is not None else None
        return asyncio.run(profile_server(dep.address, engine, bytes_per_token, shared_cores, cost))
