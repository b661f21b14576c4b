"""The chaos suite's parts: reference outputs with their top-2 margins, a closed-loop client, a driver
that SIGKILLs and SIGSTOPs worker processes, and the end-of-run checks.

Everything is bounded: the client loop and the driver stop at a deadline, every RPC has a timeout, and
the driver signals only the worker processes this test's own server started (their pids come from the
workers themselves, `WorkerInfo.pid`), never anything else on the machine.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from engine import SamplingParams
from tests.engine.helpers import make_engine, run_capturing_logits
from tests.serving.conftest import RunningServer, greedy_request, token_ids

NEAR_TIE = 1e-3  # a top-2 logit margin below this: two numerically equal choices


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` distinct token-id prompts of mixed length (16 to ~600 tokens)."""
    rng = random.Random(seed)
    lengths = [16, 40, 96, 200, 350, 600]
    return [[rng.randrange(100, 40000) for _ in range(lengths[i % len(lengths)] + i)] for i in range(n)]


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each generated position


def references(prompt_ids: list[list[int]], max_tokens: list[int], kv_cache_dtype: str | None = None
               ) -> list[Reference]:
    """Greedy outputs of the engine alone (no serving, no failures), with each step's top-2 margin."""
    engine = make_engine("smollm2-135m", num_blocks=1024, max_num_batched_tokens=2048,
                         kv_cache_dtype=kv_cache_dtype)
    for i, (p, n) in enumerate(zip(prompt_ids, max_tokens)):
        engine.scheduler.add(_request(engine, str(i), p, n))
    logits = run_capturing_logits(engine)
    out = []
    for i in range(len(prompt_ids)):
        rows = logits[str(i)]
        top2 = torch.stack([r.float().topk(2).values for r in rows])
        tokens = [int(r.argmax()) for r in rows]
        out.append(Reference(_until_stop(engine, tokens, max_tokens[i]), (top2[:, 0] - top2[:, 1]).tolist()))
    del engine
    return out


def _request(engine, rid: str, prompt: list[int], max_tokens: int):
    from engine.request import Request

    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   engine.cache_spec.block_size, engine.eos_token_ids, engine.max_model_len)


def _until_stop(engine, tokens: list[int], max_tokens: int) -> list[int]:
    for i, t in enumerate(tokens):
        if t in engine.eos_token_ids:
            return tokens[:i + 1]
    return tokens[:max_tokens]


@dataclass
class Outcome:
    completed: int = 0
    exact: int = 0
    near_ties: list[tuple[int, int, float]] = field(default_factory=list)  # (prompt, position, margin)
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    migrated: int = 0


def check(got: list[int], ref: Reference, i: int, outcome: Outcome) -> None:
    """Exact, or diverging first at a numerical near-tie of the reference (reported, never loosened)."""
    if got == ref.tokens:
        outcome.exact += 1
        return
    pos = next((k for k, (a, b) in enumerate(zip(got, ref.tokens)) if a != b), min(len(got), len(ref.tokens)))
    margin = ref.margins[pos] if pos < len(ref.margins) else float("inf")
    if margin < NEAR_TIE:
        outcome.near_ties.append((i, pos, margin))
    else:
        outcome.mismatches.append(f"prompt {i}: first differs at token {pos} (reference top-2 margin "
                                  f"{margin:.3g}): got {got[max(0, pos - 2):pos + 3]}, want "
                                  f"{ref.tokens[max(0, pos - 2):pos + 3]}")


def closed_loop(server: RunningServer, prompt_ids: list[list[int]], max_tokens: list[int],
                refs: list[Reference], concurrency: int, duration_s: float, rpc_timeout_s: float = 240.0
                ) -> Outcome:
    """`concurrency` clients, each sending its next request as soon as the last ends, for `duration_s`."""
    outcome = Outcome()
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s
    stub = server.stub

    def client(c: int) -> None:
        k = c
        while time.monotonic() < stop_at:
            i = k % len(prompt_ids)
            k += concurrency
            try:
                responses = list(stub.Generate(greedy_request(prompt_ids[i], max_tokens[i]),
                                               timeout=rpc_timeout_s))
            except grpc.RpcError as e:
                with lock:
                    outcome.errors.append(f"prompt {i}: {e.code().name}: {e.details()}")
                continue
            with lock:
                outcome.completed += 1
                check(token_ids(responses), refs[i], i, outcome)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + rpc_timeout_s + 30)
    return outcome


@dataclass
class ChaosLog:
    events: list[str] = field(default_factory=list)


def worker_pids(server: RunningServer, kind: str | None = None) -> dict[str, int]:
    return {w.worker_id: w.info.pid for w in server.server.registry.live()
            if kind is None or w.kind.value == kind}


class ChaosDriver(threading.Thread):
    """SIGKILLs a random live worker every `kill_every_s` (a range), and once SIGSTOPs one for `stop_s`,
    until `duration_s` has passed. Only pids of this server's own workers are ever signalled."""

    def __init__(self, server: RunningServer, duration_s: float, kill_every_s: tuple[float, float],
                 stop_s: float, stop_at_s: float, seed: int = 0, kinds: tuple[str, ...] = ("prefill", "decode")
                 ) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.duration_s = duration_s
        self.kill_every_s = kill_every_s
        self.stop_s = stop_s
        self.stop_at_s = stop_at_s
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.log = ChaosLog()
        self.started = set(worker_pids(server).values())  # every pid this driver may ever signal

    def _ours(self) -> dict[str, int]:
        pids = {}
        for kind in self.kinds:
            pids.update(worker_pids(self.server, kind))
        self.started |= set(pids.values())
        return pids

    def run(self) -> None:
        t0 = time.monotonic()
        next_kill = t0 + self.rng.uniform(*self.kill_every_s)
        stop_due = t0 + self.stop_at_s
        while time.monotonic() - t0 < self.duration_s:
            now = time.monotonic()
            if stop_due is not None and now >= stop_due:
                stop_due = None
                self._stop_one(t0)
            elif now >= next_kill:
                pids = self._ours()
                if pids:
                    wid = self.rng.choice(sorted(pids))
                    self._signal(pids[wid], signal.SIGKILL)
                    self.log.events.append(f"{now - t0:5.1f}s SIGKILL {wid} (pid {pids[wid]})")
                next_kill = now + self.rng.uniform(*self.kill_every_s)
            time.sleep(0.1)

    def _stop_one(self, t0: float) -> None:
        pids = self._ours()
        if not pids:
            return
        wid = self.rng.choice(sorted(pids))
        pid = pids[wid]
        self._signal(pid, signal.SIGSTOP)
        self.log.events.append(f"{time.monotonic() - t0:5.1f}s SIGSTOP {wid} (pid {pid}) for {self.stop_s:.0f}s")
        time.sleep(self.stop_s)
        self._signal(pid, signal.SIGCONT)  # it was declared dead and killed meanwhile, if liveness works
        self.log.events.append(f"{time.monotonic() - t0:5.1f}s SIGCONT {wid}")

    def _signal(self, pid: int, sig: int) -> None:
        assert pid in self.started, f"pid {pid} is not one of this test's workers"
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_recovered(server: RunningServer, targets: dict[str, int], timeout: float = 120.0) -> dict:
    """Wait until every pool is back at its target size and no live worker holds a block or a sequence;
    returns the last reports (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = {k: len(worker_pids(server, k)) for k in targets}
        if live == targets:
            break
        time.sleep(0.5)
    return server.wait_idle(max(5.0, deadline - time.monotonic()))
