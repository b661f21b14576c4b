"""The pool manager's liveness watch and replacement over fake workers (no Ray): a stalled worker is
declared dead, killed and replaced; a transient unavailability is not death; failed starts back off."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine.config import EngineConfig
from protocol import PoolKind
from protocol.messages import Heartbeat
from router.pool import LivenessConfig, PoolManager, PoolSpec
from router.registry import WorkerRegistry
from router.worker_client import Failure, WorkerError
from tests.router.fakes import FakeWorker, until

FAST = LivenessConfig(worker_timeout_s=0.2, interval_s=0.02, backoff_initial_s=0.05, backoff_max_s=0.2)


class Fleet:
    """Fake workers handed out by a launcher; `fail_starts` makes the next launches fail."""

    def __init__(self) -> None:
        self.started: dict[str, FakeWorker] = {}
        self.fail_starts = 0
        self.attempts = 0
        self.contract: str | None = None  # set: the next workers run other code (their protocol.messages)

    async def launch(self, spec: PoolSpec, worker_id: str) -> FakeWorker:
        self.attempts += 1
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError("no node offers the pool's resources")
        w = self.started[worker_id] = FakeWorker(worker_id, spec.kind)
        if self.contract is not None:
            info = dataclasses.replace(w.describe(), contract=self.contract)
            w.describe = lambda: info
        return w


def manager(fleet: Fleet, n: int = 2) -> tuple[PoolManager, WorkerRegistry, list[tuple[str, str]]]:
    registry = WorkerRegistry()
    lost: list[tuple[str, str]] = []
    registry.on_lost.append(lambda w, why: lost.append((w.worker_id, why)))
    spec = PoolSpec(PoolKind.DECODE, n, EngineConfig(model="tiny-random"))
    return PoolManager([spec], registry, fleet.launch, FAST), registry, lost



def test_a_stalled_worker_is_declared_dead_killed_and_replaced():
    async def go():
        fleet = Fleet()
        pm, registry, lost = manager(fleet)
        await pm.start()
        maintain = asyncio.ensure_future(pm.maintain())
        fleet.started["decode-0"].stall()  # SIGSTOP: no ping answered
        await until(lambda: lost)
        assert lost[0][0] == "decode-0" and "no heartbeat" in lost[0][1]
        assert fleet.started["decode-0"].killed
        await until(lambda: len(registry.live(PoolKind.DECODE)) == 2)
        assert sorted(w.worker_id for w in registry.live()) == ["decode-1", "decode-2"]
        maintain.cancel()
        await pm.close()

    asyncio.run(go())


def test_an_engine_loop_that_stopped_moving_with_work_is_declared_dead():
    async def go():
        fleet = Fleet()
        pm, registry, lost = manager(fleet, 1)
        await pm.start()
        w = fleet.started["decode-0"]

        async def stuck_ping(timeout):
            return Heartbeat(w.worker_id, loop_age_s=5.0, busy=True, loop_alive=True)

        w.ping = stuck_ping
        await until(lambda: lost)
        assert "has not moved" in lost[0][1] and w.killed
        await pm.close()

    asyncio.run(go())


def test_an_idle_worker_with_a_quiet_loop_and_a_transient_unavailability_are_not_death():
    async def go():
        fleet = Fleet()
        pm, registry, lost = manager(fleet, 1)
        await pm.start()
        w = fleet.started["decode-0"]
        calls = 0

        async def flaky_ping(timeout):
            nonlocal calls
            calls += 1
            if calls % 2:
                raise WorkerError(w.worker_id, "unavailable: connection reset", Failure.UNAVAILABLE)
            return Heartbeat(w.worker_id, loop_age_s=5.0, busy=False, loop_alive=True)  # idle: fine

        w.ping = flaky_ping
        await asyncio.sleep(0.5)
        assert calls >= 4 and lost == [] and not w.killed
        await pm.close()

    asyncio.run(go())


def test_a_dead_engine_thread_is_death():
    async def go():
        fleet = Fleet()
        pm, registry, lost = manager(fleet, 1)
        await pm.start()
        w = fleet.started["decode-0"]

        async def dead_loop(timeout):
            return Heartbeat(w.worker_id, loop_age_s=0.0, busy=False, loop_alive=False)

        w.ping = dead_loop
        await until(lambda: lost)
        assert "engine loop thread is dead" in lost[0][1]
        await pm.close()

    asyncio.run(go())


def test_failed_replacements_back_off_exponentially_and_the_pool_grows_back():
    async def go():
        fleet = Fleet()
        pm, registry, lost = manager(fleet, 1)
        await pm.start()
        maintain = asyncio.ensure_future(pm.maintain())
        fleet.fail_starts = 4
        fleet.started["decode-0"].die()
        registry.lose(registry.get("decode-0"), "SIGKILL")
        await until(lambda: len(registry.live(PoolKind.DECODE)) == 1, timeout=10)
        # four failures waited 0.05 + 0.1 + 0.2 + 0.2 s: far fewer tries than one per 20 ms tick
        assert fleet.attempts == 1 + 4 + 1
        maintain.cancel()
        await pm.close()

    asyncio.run(go())


def test_workers_that_die_soon_after_every_start_back_off_and_one_that_lives_ends_the_crash_loop():
    """A worker that starts and then dies at once, again and again (a bad node, a driver fault), is replaced
    after a growing wait, not as fast as it can load; a worker that outlives the crash window resets it."""

    async def go():
        fleet = Fleet()
        registry = WorkerRegistry()
        spec = PoolSpec(PoolKind.DECODE, 1, EngineConfig(model="tiny-random"))
        cfg = dataclasses.replace(FAST, crash_window_s=0.6, crash_loop_after=3, backoff_max_s=0.4)
        pm = PoolManager([spec], registry, fleet.launch, cfg)
        await pm.start()
        maintain = asyncio.ensure_future(pm.maintain())
        crashing = True

        async def crash_each_new_worker() -> None:
            while crashing:
                for w in registry.live(PoolKind.DECODE):
                    fleet.started[w.worker_id].die()
                    registry.lose(w, "SIGSEGV right after its start")
                await asyncio.sleep(0.005)

        killer = asyncio.ensure_future(crash_each_new_worker())
        await asyncio.sleep(1.5)
        crashing = False
        await killer
        # without the backoff: a start per 20 ms tick, ~75. With it, 3 quick losses, then waits of
        # 0.05 + 0.1 + 0.2 + 0.4 + 0.4 + ... s: about 8
        assert 4 <= fleet.attempts <= 12, fleet.attempts
        assert pm.backoff_left(PoolKind.DECODE) > 0  # what pdserve_pool_replacement_backoff_seconds shows
        await until(lambda: len(registry.live(PoolKind.DECODE)) == 1, timeout=5)
        # it outlives the window (0.6 s): the pool is healthy again
        await until(lambda: pm._quick_losses[PoolKind.DECODE] == 0 and pm._backoff[PoolKind.DECODE] == 0
                    and pm.backoff_left(PoolKind.DECODE) == 0, timeout=5)
        before = fleet.attempts
        w = registry.live(PoolKind.DECODE)[0]
        fleet.started[w.worker_id].die()
        registry.lose(w, "SIGKILL")  # one loss after a healthy run is replaced at once
        await until(lambda: len(registry.live(PoolKind.DECODE)) == 1, timeout=0.5)
        assert fleet.attempts == before + 1
        maintain.cancel()
        await pm.close()

    asyncio.run(go())


def test_a_node_lost_under_several_fresh_workers_is_one_failure_not_a_crash_loop():
    """Four workers started together and lost together (their node went) within the crash window: one quick
    loss, so their replacements start at once."""

    async def go():
        fleet = Fleet()
        pm, registry, _ = manager(fleet, 4)
        pm.liveness = dataclasses.replace(FAST, crash_window_s=30.0, crash_loop_after=2)
        await pm.start()
        for w in registry.live(PoolKind.DECODE):
            fleet.started[w.worker_id].die()
            registry.lose(w, "its node left")
        assert pm.backoff_left(PoolKind.DECODE) == 0 and pm._quick_losses[PoolKind.DECODE] == 1
        maintain = asyncio.ensure_future(pm.maintain())
        await until(lambda: len(registry.live(PoolKind.DECODE)) == 4, timeout=2)
        assert fleet.attempts == 8
        maintain.cancel()
        await pm.close()

    asyncio.run(go())


def test_a_worker_running_other_code_is_refused_killed_and_its_replacement_backs_off():
    """The router and its workers exchange pickled `protocol.messages` types: a worker from another build (a
    node with another image, a checkout edited under a running deployment) is refused at its start, before
    it takes traffic, instead of failing every stream it is given and being replaced in a tight loop."""

    async def go():
        fleet = Fleet()
        fleet.contract = "0123456789ab"
        pm, registry, _ = manager(fleet, 1)
        with pytest.raises(RuntimeError, match="other pdserve code than this router.*0123456789ab"):
            await pm.start()
        assert fleet.started["decode-0"].killed and not registry.live()
        maintain = asyncio.ensure_future(pm.maintain())
        await asyncio.sleep(0.5)
        # refused again and again, but backing off: 0.05 + 0.1 + 0.2 + 0.2 s, not a start every 20 ms tick
        assert 2 <= fleet.attempts <= 6 and not registry.live()
        assert all(w.killed for w in fleet.started.values())
        fleet.contract = None  # the deployment runs one build again: the pool fills
        await until(lambda: len(registry.live(PoolKind.DECODE)) == 1, timeout=5)
        maintain.cancel()
        await pm.close()

    asyncio.run(go())


def test_a_following_manager_never_kills_or_declares_dead_and_can_take_a_worker_back():
    """A router replica that is not the lead: a silent worker stays (the lead decides); losing touch with one
    kills nothing, and the replica can adopt it again."""

    async def main():
        registry = WorkerRegistry(kill_on_loss=False)
        spec = PoolSpec(PoolKind.DECODE, 1, EngineConfig(model="tiny-random"))

        async def no_launch(spec, worker_id):
            raise AssertionError("a following manager starts no worker")

        pools = PoolManager([spec], registry, no_launch, FAST, follow=True)
        fake = FakeWorker("decode-0", PoolKind.DECODE)
        first = pools.adopt(fake.describe(), fake)
        assert pools.adopt(fake.describe(), fake) is first  # again while live: a no-op
        fake.stall()  # no heartbeat: the lead's liveness would declare it dead; a follower waits
        await asyncio.sleep(FAST.worker_timeout_s * 3)
        assert first.alive and not fake.killed
        registry.lose(first, "its step stream broke")  # this replica lost touch with it
        assert not first.alive and not fake.killed
        again = pools.adopt(fake.describe(), fake)
        assert again is not first and again.alive and registry.get("decode-0") is again
        await pools.close()

    asyncio.run(main())
