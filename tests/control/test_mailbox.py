"""The router replicas' mailbox (`control.mailbox.AdminMailbox`) as a plain object: who may take the lead
and when, what a deposed lead is told, and what happens to Admin calls across a takeover."""

from __future__ import annotations

import asyncio
import time

import pytest

from control.mailbox import AdminMailbox
from control.messages import LeadClaim, LeadInfo, ProcessInfo
from engine.config import EngineConfig
from protocol import PoolKind
from protocol.messages import WorkerInfo
from router.pool import PoolManager, PoolSpec
from router.registry import WorkerRegistry, make_worker


def run(coro):
    return asyncio.run(coro)


def test_the_lead_is_claimed_only_after_its_silence_and_by_one_replica():
    async def scenario():
        box = AdminMailbox()
        lead = ProcessInfo(1, "node-a", b"pdserve")
        assert await box.beat(None, {PoolKind.PREFILL: 2}, lead) == ("lead", 0.0)
        assert await box.claim_lead("1.1", 1, silent_s=5.0) is None  # it just beat
        box._beat = time.monotonic() - 6  # silent for longer than --worker-timeout
        await box.register(2, "2.2")
        await box.register_worker("prefill-0")
        claim = await box.claim_lead("1.1", 1, silent_s=5.0)
        assert claim == LeadClaim(old_router_id=None, old_index=0, old_process=lead, targets={PoolKind.PREFILL: 2},
                                  replicas={2: "2.2"}, workers=("prefill-0",))
        assert await box.describe() == LeadInfo("1.1", 1, None, {2: "2.2"})  # the old lead's process is spent
        assert await box.claim_lead("2.2", 2, silent_s=5.0) is None  # the new lead's claim renewed the beat
        assert await box.beat(None, {}) == ("deposed", 0.0)  # the old lead, if it wakes up
        assert await box.beat("1.1", {}) == ("lead", 0.0)

    run(scenario())


def test_a_stop_request_reaches_whoever_leads_but_a_closing_deployment_takes_no_new_lead():
    async def scenario():
        box = AdminMailbox()
        assert await box.request_stop(7.0) is None
        assert await box.beat(None, {}) == ("stop", 7.0)
        box._beat = time.monotonic() - 6  # the lead died before it acted: a replica still takes over ...
        assert await box.claim_lead("1.1", 1, silent_s=5.0) is not None
        assert await box.beat("1.1", {}) == ("stop", 7.0)  # ... and finds the request at its first beat
        await box.closing()
        box._beat = time.monotonic() - 6
        assert await box.claim_lead("2.2", 2, silent_s=5.0) is None  # the lead is stopping everything

    run(scenario())


def test_a_call_the_dead_lead_took_fails_unavailable_and_a_stale_poll_hands_calls_on():
    async def scenario():
        box = AdminMailbox()
        taken = asyncio.ensure_future(box.call("ListWorkers", b"a"))
        n, method, _ = await box.next(None)  # the old lead takes it, then dies
        assert method == "ListWorkers"
        stale = asyncio.ensure_future(box.next(None))  # its poll is still waiting
        box._beat = time.monotonic() - 6
        await box.claim_lead("1.1", 1, silent_s=5.0)
        ok, (code, details) = await asyncio.wait_for(taken, 1)
        assert not ok and code == "UNAVAILABLE" and "retry" in details
        second = asyncio.ensure_future(box.call("ScalePool", b"b"))
        assert await asyncio.wait_for(stale, 1) is None  # the stale poll gives the call back ...
        n2, method2, _ = await asyncio.wait_for(box.next("1.1"), 1)  # ... to the new lead
        assert method2 == "ScalePool"
        await box.answer(n2, (True, b"ok"))
        assert await second == (True, b"ok")

    run(scenario())


def test_registered_names_cover_every_replica_and_worker_ever_started():
    async def scenario():
        box = AdminMailbox()
        await box.register(1, "1.1")
        await box.register(1, "1.3")  # a replacement under the same index
        await box.register_worker("prefill-0")
        assert sorted(await box.names()) == ["prefill-0", "router-1.1", "router-1.3"]

    run(scenario())


@pytest.mark.parametrize("ids, expected", [(["prefill-0", "prefill-3", "decode-1"], {"prefill": 4, "decode": 2}),
                                           ([], {"prefill": 0, "decode": 0})])
def test_a_promoted_manager_numbers_new_workers_after_every_id_it_has_seen(ids, expected):
    registry = WorkerRegistry(kill_on_loss=False)
    for worker_id in ids:
        kind = worker_id.split("-")[0]
        registry.add(make_worker(WorkerInfo(worker_id, PoolKind(kind), "n", "127.0.0.1", 16, 8), None))
    engine = EngineConfig(model="tiny-random")
    specs = [PoolSpec(PoolKind.PREFILL, 1, engine), PoolSpec(PoolKind.DECODE, 1, engine)]
    pools = PoolManager(specs, registry, launch=None, follow=True)
    pools.promote(launch="new launcher", targets={PoolKind.PREFILL: 3})
    assert not pools.follow and pools.launch == "new launcher"
    assert pools.targets == {PoolKind.PREFILL: 3, PoolKind.DECODE: 1}
    assert {k.value: n for k, n in pools._next_index.items()} == expected
