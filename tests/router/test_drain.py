"""Draining a worker over fake workers: its sequences move with their KV (or recompute), the client's
stream goes on token for token, the drained worker ends up holding nothing, and nothing new lands on it."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol import Method, PoolKind
from router.lifecycle import Phase
from router.observer import RequestObserver
from tests.router.fakes import FakeCluster, FakeWorker, reference

PROMPT = list(range(1, 23))  # 22 tokens: 6 blocks of 4


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class Migrations(RequestObserver):
    def __init__(self) -> None:
        self.migrations: list[tuple[str, str]] = []
        self.pauses: list[tuple[str, float]] = []

    def on_migration(self, state, cause, method):
        self.migrations.append((cause, method))

    def on_migration_pause(self, method, seconds):
        self.pauses.append((method, seconds))


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def _decoding_on(c: FakeCluster, worker_id: str) -> int:
    return sum(1 for a in c.router._attempts.values()
               if a.phase is Phase.DECODING and a.decode is not None and a.decode.worker_id == worker_id)


def _cluster(num_decode: int = 2, **config) -> tuple[FakeCluster, Migrations]:
    c = FakeCluster(1, num_decode, **config)
    obs = c.router.observer = Migrations()
    for w in c.workers.values():
        w.step_s = 0.004
    return c, obs


async def _drain_under_load(c: FakeCluster, n: int, method: Method, max_tokens: int = 120):
    """n streams start on decode-0 (decode-1 joins the placement only after), then decode-0 is drained."""
    c.router.workers["decode-1"].draining = True  # keep it out of placement until the drain
    prompts = [[p + i for p in PROMPT] for i in range(n)]
    tasks = [asyncio.ensure_future(c.collect(c.request(f"r{i}", p, max_tokens))) for i, p in enumerate(prompts)]
    await _until(lambda: _decoding_on(c, "decode-0") == n)
    c.router.workers["decode-1"].draining = False
    drained = await c.router.drain_worker(c.router.workers["decode-0"], method)
    # once the drain says so, the worker holds nothing: every attempt that left it has been aborted there
    assert c["decode-0"].blocks_in_use == 0
    results = await asyncio.gather(*tasks)
    await c.settle()
    return prompts, results, drained


def test_a_drained_decode_worker_moves_every_sequence_with_its_kv():
    async def go():
        c, obs = _cluster(verify_kv_moves=True)
        prompts, results, drained = await _drain_under_load(c, 8, Method.KV)
        assert drained
        for prompt, (tokens, finish, state) in zip(prompts, results):
            assert tokens == reference(prompt, 120), "a moved stream lost, repeated or changed a token"
            assert finish == "length"
            assert state.decode_worker == "decode-1"
            assert Phase.MIGRATING in state.history and Phase.QUEUED not in state.history[1:]
            assert not state.failures, "a drain is not a failure"
        assert len(c["decode-0"].moved_out) == 8
        assert c["decode-0"].connected == ["decode-1"]  # its link was opened before the first move
        assert obs.migrations == [("drain", "kv")] * 8
        assert [m for m, _ in obs.pauses] == ["kv"] * 8
        moves = list(c.router.kv_moves)
        assert len(moves) == 8 and all(m.result.ok and m.src_digest == m.dst_digest for m in moves)
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}
        assert c["prefill-0"].keys.count("r1.1") <= 1  # nothing was prefilled again
        assert all(k.endswith(".1") for k in c["prefill-0"].keys)

    run(go())


def test_a_failed_kv_move_falls_back_to_recompute_without_counting_as_a_failure():
    async def go():
        c, obs = _cluster()
        c["decode-0"].fail_next_move = True
        prompts, results, drained = await _drain_under_load(c, 3, Method.KV)
        assert drained
        for prompt, (tokens, _, state) in zip(prompts, results):
            assert tokens == reference(prompt, 120)
            assert not state.failures
        assert sorted(obs.migrations) == [("drain", "kv"), ("drain", "kv"), ("drain", "recompute")]
        # the recomputed one was prefilled again (its prompt grown by the tokens it had streamed)
        assert sum(1 for k in c["prefill-0"].keys if not k.endswith(".1")) == 1
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}

    run(go())


def test_a_moved_kv_that_differs_from_its_source_is_forgotten_there_and_the_stream_recomputes():
    async def go():
        c, obs = _cluster(verify_kv_moves=True)
        c["decode-1"].corrupt_next_check = True
        prompts, results, drained = await _drain_under_load(c, 3, Method.KV)
        assert drained
        assert [tokens for tokens, _, _ in results] == [reference(p, 120) for p in prompts]
        assert sorted(obs.migrations) == [("drain", "kv"), ("drain", "kv"), ("drain", "recompute")]
        (bad,) = [m for m in c.router.kv_moves if m.src_digest != m.dst_digest]
        assert [key for key, _ in c["decode-1"].forgotten] == [f"{bad.request_id}.2"]
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}

    run(go())


def test_drain_by_recompute_is_exact_too():
    async def go():
        c, obs = _cluster()
        prompts, results, drained = await _drain_under_load(c, 4, Method.RECOMPUTE)
        assert drained
        assert [tokens for tokens, _, _ in results] == [reference(p, 120) for p in prompts]
        assert obs.migrations == [("drain", "recompute")] * 4
        assert not c["decode-0"].moved_out
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}

    run(go())


def test_nothing_new_is_placed_on_a_draining_worker():
    async def go():
        c, _ = _cluster()
        c.router.workers["decode-0"].draining = True
        results = await asyncio.gather(*(c.collect(c.request(f"r{i}", PROMPT, 5)) for i in range(6)))
        assert {state.decode_worker for _, _, state in results} == {"decode-1"}
        assert not c["decode-0"].keys

    run(go())


def test_a_drain_waits_for_a_place_to_move_to():
    """A one-worker pool (a rolling restart's first step): sequences stay until a new worker is ready."""

    async def go():
        c, obs = _cluster(num_decode=1)
        task = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 400)))
        await _until(lambda: _decoding_on(c, "decode-0") == 1)
        drain = asyncio.ensure_future(c.router.drain_worker(c.router.workers["decode-0"], Method.KV))
        await asyncio.sleep(0.1)
        assert not drain.done() and not obs.migrations  # nowhere to go yet: it keeps decoding
        c.add(FakeWorker("decode-1", PoolKind.DECODE, step_s=0.004))
        assert await drain
        tokens, _, state = await task
        assert tokens == reference(PROMPT, 400)
        assert state.decode_worker == "decode-1"
        assert obs.migrations == [("drain", "kv")]

    run(go())


def test_draining_a_prefill_worker_lets_its_prompts_finish_and_moves_nothing():
    async def go():
        c = FakeCluster(2, 1)
        c["prefill-0"].prefill_gate.clear()
        c.router.workers["prefill-1"].draining = True
        task = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 8)))
        await c["prefill-0"].prefill_started.wait()
        c.router.workers["prefill-1"].draining = False
        drain = asyncio.ensure_future(c.router.drain_worker(c.router.workers["prefill-0"]))
        await asyncio.sleep(0.05)
        assert not drain.done()  # its prompt is still computing
        later = await c.collect(c.request("b", PROMPT, 3))
        assert later[2].prefill_worker == "prefill-1"
        c["prefill-0"].prefill_gate.set()
        assert await drain
        tokens, _, state = await task
        assert tokens == reference(PROMPT, 8) and state.prefill_worker == "prefill-0"
        assert state.history == [Phase.QUEUED, Phase.PREFILLING, Phase.DECODING, Phase.FINISHED]

    run(go())


@pytest.mark.parametrize("when", ["before_move", "after_move"])
def test_a_client_cancelling_around_a_move_leaks_nothing(when):
    async def go():
        c, _ = _cluster()
        c.router.workers["decode-1"].draining = True
        seen = asyncio.Event()
        moved = asyncio.Event()
        tokens: list[int] = []

        async def client():
            async for event, state in c.router.generate(c.request("a", PROMPT, 400)):
                tokens.extend(event.token_ids)
                if state.phase is Phase.DECODING:
                    seen.set()
                if state.decode_worker == "decode-1":
                    moved.set()
                    await asyncio.sleep(3600)

        task = asyncio.ensure_future(client())
        await seen.wait()
        c.router.workers["decode-1"].draining = False
        drain = asyncio.ensure_future(c.router.drain_worker(c.router.workers["decode-0"]))
        if when == "before_move":
            await _until(lambda: c["decode-1"].reserved or c["decode-1"].running)
        else:
            await moved.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await drain
        await c.settle()
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}
        assert tokens == reference(PROMPT, len(tokens))

    run(go())


def test_colocated_workers_drain_by_recompute():
    async def go():
        c = FakeCluster(0, 0, num_colocated=2)
        obs = c.router.observer = Migrations()
        c.router.workers["colocated-1"].draining = True
        task = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 200)))
        await _until(lambda: _decoding_on(c, "colocated-0") == 1)
        c.router.workers["colocated-1"].draining = False
        assert await c.router.drain_worker(c.router.workers["colocated-0"], Method.KV)
        tokens, _, state = await task
        assert tokens == reference(PROMPT, 200) and state.decode_worker == "colocated-1"
        assert obs.migrations == [("drain", "recompute")]

    run(go())
