"""Scale, drain and rolling restart (control.admin) over fake workers started by a real PoolManager: under
load no request fails or changes a token, placement uses new workers at once, and retired workers leave
nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from control.admin import AdminError, PoolAdmin
from engine.config import EngineConfig
from protocol import Method, PoolKind
from router.pool import LivenessConfig, PoolManager, PoolSpec
from router.registry import WorkerRegistry
from router.router import Router, RouterConfig
from tests.router.fakes import BLOCK, FakeCluster, FakeWorker, reference

PROMPT = list(range(1, 23))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


class Deployment:
    """A router and a pool manager whose launcher starts fake workers (after `start_s`, like a model load)."""

    def __init__(self, num_prefill: int = 1, num_decode: int = 1, start_s: float = 0.05) -> None:
        self.fakes: dict[str, FakeWorker] = {}
        self.registry = WorkerRegistry()
        self.router = Router(RouterConfig(block_size=BLOCK, admission_timeout_s=10, call_timeout_s=1.0,
                                          local_prefill=False), self.registry)
        self.start_s = start_s

        async def launch(spec: PoolSpec, worker_id: str) -> FakeWorker:
            await asyncio.sleep(self.start_s)
            fake = self.fakes[worker_id] = FakeWorker(worker_id, spec.kind, step_s=0.004)
            fake.peers = self.fakes
            return fake

        specs = [PoolSpec(PoolKind.PREFILL, num_prefill, EngineConfig("fake")),
                 PoolSpec(PoolKind.DECODE, num_decode, EngineConfig("fake"))]
        self.pools = PoolManager(specs, self.registry, launch, LivenessConfig(worker_timeout_s=2, interval_s=0.05),
                                 on_report=self.router.apply_report, on_heartbeat=self.router.on_heartbeat)
        self.admin = PoolAdmin(self.router, self.pools)

    async def __aenter__(self) -> Deployment:
        await self.pools.start()
        self._maintain = asyncio.ensure_future(self.pools.maintain())
        return self

    async def __aexit__(self, *exc) -> None:
        self._maintain.cancel()
        await self.pools.close()
        await self.router.close()

    collect = FakeCluster.collect
    request = FakeCluster.request

    def serving(self, kind: PoolKind = PoolKind.DECODE) -> list[str]:
        return sorted(w.worker_id for w in self.registry.schedulable(kind))

    def blocks_in_use(self) -> dict[str, int]:
        return {wid: f.blocks_in_use for wid, f in self.fakes.items() if not f.dead}


class ClosedLoop:
    """`n` clients, each sending its next request as soon as its last one ended, until stopped."""

    def __init__(self, d: Deployment, n: int, max_tokens: int = 60) -> None:
        self.d, self.max_tokens = d, max_tokens
        self.results: list[tuple[list[int], list[int], str | None, object]] = []
        self.errors: list[BaseException] = []
        self._stop = False
        self._tasks = [asyncio.ensure_future(self._client(i)) for i in range(n)]

    async def _client(self, i: int) -> None:
        k = 0
        while not self._stop:
            prompt = [p + 7 * i + k for p in PROMPT]
            k += 1
            try:
                tokens, finish, state = await self.d.collect(self.d.request(f"c{i}.{k}", prompt, self.max_tokens))
                self.results.append((prompt, tokens, finish, state))
            except Exception as e:  # noqa: BLE001 - collected: the test asserts there are none
                self.errors.append(e)

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)

    def check(self) -> None:
        assert not self.errors, self.errors
        assert self.results
        for prompt, tokens, finish, _ in self.results:
            assert (tokens, finish) == (reference(prompt, self.max_tokens), "length")


async def _settle(d: Deployment) -> None:
    deadline = time.monotonic() + 5
    while any(d.blocks_in_use().values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_scale_decode_1_to_3_to_1_under_load_fails_nothing():
    async def go():
        async with Deployment() as d:
            load = ClosedLoop(d, 6)
            await asyncio.sleep(0.2)
            up = await d.admin.scale(PoolKind.DECODE, 3)
            assert up.started == ["decode-1", "decode-2"] and up.pool.serving == 3
            ready_at = time.monotonic()
            # placement uses the new workers as soon as they are ready
            while not (d.fakes["decode-1"].keys and d.fakes["decode-2"].keys):
                assert time.monotonic() - ready_at < 1.0, "new workers got no traffic within a second"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            down = await d.admin.scale(PoolKind.DECODE, 1)
            assert len(down.retired) == 2 and down.pool.serving == 1 and down.pool.target == 1
            await asyncio.sleep(0.2)
            await load.stop()
            load.check()
            assert len(d.serving()) == 1 and d.pools.targets[PoolKind.DECODE] == 1
            await _settle(d)
            assert not any(d.blocks_in_use().values())
            for wid in down.retired:
                assert d.fakes[wid].dead and not d.registry.get(wid).alive

    run(go())


def test_a_rolling_restart_of_the_decode_pool_fails_nothing_and_replaces_every_worker():
    async def go():
        async with Deployment(num_decode=2) as d:
            load = ClosedLoop(d, 6, max_tokens=80)
            await asyncio.sleep(0.2)
            outcomes = await d.admin.restart(PoolKind.DECODE)
            assert [o.worker_id for o in outcomes] == ["decode-0", "decode-1"]
            assert [o.replacement for o in outcomes] == ["decode-2", "decode-3"]
            assert all(o.clean and o.blocks_held_at_exit == 0 for o in outcomes)
            assert sum(o.moved.get(Method.KV, 0) for o in outcomes) > 0  # it moved live sequences
            await asyncio.sleep(0.2)
            await load.stop()
            load.check()
            assert d.serving() == ["decode-2", "decode-3"]
            await _settle(d)
            assert not any(d.blocks_in_use().values())

    run(go())


def test_a_rolling_restart_of_a_one_worker_pool_starts_the_new_one_first():
    async def go():
        async with Deployment(num_decode=1, start_s=0.3) as d:
            load = ClosedLoop(d, 3)
            await asyncio.sleep(0.1)
            restart = asyncio.ensure_future(d.admin.restart(PoolKind.DECODE))
            await asyncio.sleep(0.1)
            assert d.serving() == ["decode-0"]  # still serving while its replacement loads
            (outcome,) = await restart
            assert outcome.replacement == "decode-1"
            await load.stop()
            load.check()

    run(go())


def test_draining_the_prefill_pool_worker_with_replace_keeps_serving():
    async def go():
        async with Deployment() as d:
            load = ClosedLoop(d, 4)
            await asyncio.sleep(0.2)
            out = await d.admin.drain("prefill-0", replace=True)
            assert out.clean and out.replacement == "prefill-1" and not out.moved
            await asyncio.sleep(0.2)
            await load.stop()
            load.check()
            assert d.serving(PoolKind.PREFILL) == ["prefill-1"]

    run(go())


def test_admin_refusals_name_the_problem():
    async def go():
        async with Deployment(num_decode=2) as d:
            with pytest.raises(AdminError) as e:
                await d.admin.scale(PoolKind.DECODE, 0)
            assert e.value.code == "INVALID_ARGUMENT" and "num_workers" in str(e.value)
            with pytest.raises(AdminError) as e:  # a typo of 100000 must not start 100000 actors
                await d.admin.scale(PoolKind.PREFILL, 100_000)
            assert e.value.code == "INVALID_ARGUMENT" and "at most 64" in str(e.value)
            assert d.pools.targets[PoolKind.PREFILL] == 1 and d.pools.pending[PoolKind.PREFILL] == 0
            with pytest.raises(AdminError) as e:
                await d.admin.scale(PoolKind.COLOCATED, 2)
            assert e.value.code == "INVALID_ARGUMENT" and "no colocated pool" in str(e.value)
            with pytest.raises(AdminError) as e:
                await d.admin.drain("decode-9")
            assert e.value.code == "NOT_FOUND" and "decode-0" in str(e.value)
            with pytest.raises(AdminError) as e:
                await d.admin.drain("prefill-0")
            assert e.value.code == "FAILED_PRECONDITION" and "last serving prefill" in str(e.value)
            # one change per pool at a time
            d.start_s = 0.3
            slow = asyncio.ensure_future(d.admin.scale(PoolKind.DECODE, 3))
            await asyncio.sleep(0.05)
            with pytest.raises(AdminError) as e:
                await d.admin.drain("decode-0")
            assert e.value.code == "ABORTED"
            await slow
            assert d.serving() == ["decode-0", "decode-1", "decode-2"]

    run(go())


def test_scaling_down_cancels_starts_the_cluster_could_not_place_so_a_lost_worker_is_replaced():
    """A scale-up that outgrew the cluster leaves a start waiting for room; scaling back down cancels it, so it
    cannot take the room a lost worker's replacement needs once room frees (it used to, and the prefill
    pool stayed empty)."""

    async def go():
        async with Deployment() as d:
            d.start_s = 60.0  # no node can take another worker: its start waits
            with pytest.raises(AdminError) as e:
                await d.admin.scale(PoolKind.DECODE, 2, timeout_s=0.3)
            assert e.value.code == "DEADLINE_EXCEEDED"
            assert d.pools.pending[PoolKind.DECODE] == 1
            await d.admin.scale(PoolKind.DECODE, 1)
            for _ in range(100):
                if d.pools.pending[PoolKind.DECODE] == 0:
                    break
                await asyncio.sleep(0.02)
            assert d.pools.pending[PoolKind.DECODE] == 0, "the start no longer needed is still waiting"
            d.start_s = 0.05  # room again: only the lost prefill worker's replacement may take it
            d.fakes["prefill-0"].kill()
            d.registry.lose(d.registry.get("prefill-0"), "killed by the test")
            for _ in range(100):
                if d.serving(PoolKind.PREFILL):
                    break
                await asyncio.sleep(0.02)
            assert d.serving(PoolKind.PREFILL) == ["prefill-1"] and d.serving() == ["decode-0"]
            assert d.pools.pending == {PoolKind.PREFILL: 0, PoolKind.DECODE: 0}
            assert "decode-1" not in d.fakes  # its launch never got to create a worker

    run(go())


def test_a_drain_past_its_timeout_retires_the_worker_and_its_streams_fail_over():
    async def go():
        async with Deployment(num_decode=2) as d:
            task = asyncio.ensure_future(d.collect(d.request("a", PROMPT, 300)))
            while not any(f.running for f in d.fakes.values()):
                await asyncio.sleep(0.005)
            holder = next(wid for wid, f in d.fakes.items() if f.running)
            d.fakes[holder].hold = _never_holds  # it cannot be moved (always "not decoding right now")
            out = await d.admin.drain(holder, timeout_s=0.3)
            assert not out.clean
            tokens, finish, state = await task
            assert tokens == reference(PROMPT, 300) and finish == "length"
            assert [f.cause.value for f in state.failures] == ["decode_lost"]
            with contextlib.suppress(KeyError):
                assert not d.registry.get(holder).alive

    run(go())


async def _never_holds(key, timeout):
    return None
