"""Late decode reservation over fake workers: a prompt longer than its prefill worker's horizon is sent with
no decode blocks reserved; they are reserved when the prefill worker asks (its last chunk near), so a
decode worker's blocks serve decoding sequences, not prompts queued elsewhere. Exact output, nothing held
after, and the paths that go wrong: a full decode worker when the prompt is due, the chosen decode worker
lost before then, the prefill worker lost while the prompt waits."""

from __future__ import annotations

import asyncio

import pytest

from protocol.messages import LoadReport
from router.lifecycle import Phase
from router.router import RouterError
from tests.router.fakes import FakeCluster, reference, until

LONG = list(range(1, 41))  # 40 tokens, 10 blocks of 4: past the horizon below
SHORT = list(range(1, 9))
HORIZON = 16


async def nothing_held(c: FakeCluster) -> None:
    await c.settle()
    assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}
    assert c.registry.get("decode-0").promised_blocks == 0


async def start_deferred(c: FakeCluster, max_tokens: int) -> tuple[asyncio.Task, str]:
    """A LONG prompt, held on prefill-0 (its gate closed) with no decode blocks reserved: the running request
    and the decode worker it was promised to."""
    p = c["prefill-0"]
    p.prefill_gate.clear()
    task = asyncio.ensure_future(c.collect(c.request("a", LONG, max_tokens)))
    await until(lambda: p.keys)
    await c.settle()
    chosen = next(w for w in c.workers if w.startswith("decode-") and c.registry.get(w).promised_blocks)
    return task, chosen


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))



def test_a_long_prompt_holds_no_decode_block_until_its_prefill_worker_asks():
    async def go():
        c = FakeCluster(1, 1, horizon=HORIZON)
        p, d = c["prefill-0"], c["decode-0"]
        p.prefill_gate.clear()  # the prompt queues and computes on the prefill worker
        task = asyncio.ensure_future(c.collect(c.request("a", LONG, 6)))
        await until(lambda: p.keys)
        await c.settle()
        assert d.blocks_in_use == 0 and not d.reserved  # nothing reserved while it prefills
        assert c.registry.get("decode-0").promised_blocks == 10  # but counted against the worker
        p.prefill_gate.set()  # near its last chunk: it asks, the router reserves and hands the blocks over
        tokens, finish, state = await task
        assert (tokens, finish) == (reference(LONG, 6), "length") and not state.failures
        assert [k for k, _ in p.destinations_set] == d.keys[-1:]  # the reservation it got is the one made
        await nothing_held(c)

    run(go())


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_decode_worker_is_promised_at_most_its_share_of_its_cache_and_then_reserved_at_placement(share):
    """With --routers N each replica promises 1/N of a decode worker's cache (64 blocks here), so that all of
    them together promise at most one cache: past it, a long prompt's blocks are reserved at placement."""
    async def go():
        c = FakeCluster(1, 1, horizon=HORIZON, promise_share=share)
        p, d = c["prefill-0"], c["decode-0"]
        p.prefill_gate.clear()
        prompts = [[100 * i + t for t in LONG] for i in range(1, 5)]  # 10 blocks each, no shared prefix
        tasks = [asyncio.ensure_future(c.collect(c.request(f"r{i}", x, 3))) for i, x in enumerate(prompts)]
        await until(lambda: len(p.keys) == 4)
        await c.settle()
        deferred = min(4, int(share * 64) // 10)  # 4 under the whole cache, 3 under half of it
        assert c.registry.get("decode-0").promised_blocks == 10 * deferred
        assert d.blocks_in_use == 10 * (4 - deferred)
        p.prefill_gate.set()
        for x, t in zip(prompts, tasks):
            assert (await t)[0] == reference(x, 3)
        await nothing_held(c)

    run(go())


def test_a_short_prompt_is_reserved_at_placement_as_before():
    async def go():
        c = FakeCluster(1, 1, horizon=HORIZON)
        p, d = c["prefill-0"], c["decode-0"]
        p.prefill_gate.clear()
        task = asyncio.ensure_future(c.collect(c.request("a", SHORT, 4)))
        await until(lambda: p.keys)
        assert d.blocks_in_use == 2  # within the horizon: it would ask at once, so the router does not wait
        p.prefill_gate.set()
        assert (await task)[0] == reference(SHORT, 4)
        assert not p.destinations_set

    run(go())


def test_a_prompt_due_on_a_full_decode_pool_waits_for_room_instead_of_failing():
    async def go():
        c = FakeCluster(1, 1, horizon=HORIZON)
        p, d = c["prefill-0"], c["decode-0"]
        p.prefill_gate.clear()
        task = asyncio.ensure_future(c.collect(c.request("a", LONG, 5)))
        await until(lambda: p.keys)
        d.reserve_full = True  # every block went to decoding sequences meanwhile
        p.prefill_gate.set()
        await asyncio.sleep(0.3)
        assert not task.done() and not p.destinations_set  # waiting, its KV kept on the prefill worker
        # computed but its last horizon of tokens: placement does not see 40 tokens queued on prefill-0
        assert c.registry.get("prefill-0").inflight_prefill_tokens <= HORIZON
        d.reserve_full = False  # a sequence finished
        c.router._room.set()
        tokens, _, state = await task
        assert tokens == reference(LONG, 5) and not state.failures
        assert c.registry.get("prefill-0").inflight_prefill_tokens == 0

    run(go())


def test_a_prompt_due_when_no_room_comes_fails_resource_exhausted_and_frees_both_sides():
    async def go():
        c = FakeCluster(1, 1, horizon=HORIZON, admission_timeout_s=0.5)
        d = c["decode-0"]
        d.reserve_full = True
        with pytest.raises(RouterError) as e:
            await c.collect(c.request("a", LONG, 5))
        assert e.value.code == "RESOURCE_EXHAUSTED" and "overloaded" in str(e.value)
        await nothing_held(c)

    run(go())


def test_a_prompt_due_when_the_whole_decode_pool_is_gone_fails_unavailable_not_overloaded():
    async def go():
        c = FakeCluster(1, 1, horizon=HORIZON, admission_timeout_s=0.5)
        task, chosen = await start_deferred(c, 5)
        c.kill(chosen)  # the only decode worker: no room is coming, and it is not a matter of load
        c["prefill-0"].prefill_gate.set()
        with pytest.raises(RouterError) as e:
            await task
        assert e.value.code == "UNAVAILABLE" and "no live decode worker" in str(e.value)
        await c.settle()
        assert c.blocks_in_use()["prefill-0"] == 0

    run(go())


def test_the_decode_worker_chosen_at_placement_dies_before_the_prompt_is_due_and_nothing_fails():
    async def go():
        c = FakeCluster(1, 2, horizon=HORIZON)
        task, chosen = await start_deferred(c, 6)
        other = "decode-1" if chosen == "decode-0" else "decode-0"
        c.kill(chosen)  # it held nothing for the prompt: the prompt is not failed, it goes elsewhere
        c["prefill-0"].prefill_gate.set()
        tokens, _, state = await task
        assert tokens == reference(LONG, 6) and not state.failures
        assert state.decode_worker == other

    run(go())


def test_the_prefill_worker_dies_while_the_prompt_waits_for_room_and_the_request_moves_on():
    async def go():
        c = FakeCluster(2, 1, horizon=HORIZON)
        d = c["decode-0"]
        d.reserve_full = True
        for p in ("prefill-0", "prefill-1"):
            c[p].prefill_gate.set()
        task = asyncio.ensure_future(c.collect(c.request("a", LONG, 4)))
        await until(lambda: any(c[w].destinations for w in ("prefill-0", "prefill-1")))
        first = next(w for w in ("prefill-0", "prefill-1") if c[w].destinations)
        att = next(iter(c.router._attempts.values()))
        assert att.phase is Phase.PREFILLING and att.reservation is None
        c.kill(first)
        d.reserve_full = False  # and its next load report says so
        c.router.apply_report(c.registry.get("decode-0"), LoadReport("decode-0", d._load()))
        tokens, _, state = await task
        assert tokens == reference(LONG, 4)
        assert [f.cause.value for f in state.failures] == ["prefill_lost"]
        await c.settle()
        assert c.blocks_in_use()["decode-0"] == 0 and c.registry.get("decode-0").promised_blocks == 0

    run(go())


def test_late_reservation_off_reserves_every_prompt_at_placement():
    async def go():
        c = FakeCluster(1, 1, horizon=HORIZON, late_reservation=False)
        p, d = c["prefill-0"], c["decode-0"]
        p.prefill_gate.clear()
        task = asyncio.ensure_future(c.collect(c.request("a", LONG, 4)))
        await until(lambda: p.keys)
        assert d.blocks_in_use == 10
        p.prefill_gate.set()
        assert (await task)[0] == reference(LONG, 4)

    run(go())


def test_the_chosen_decode_worker_dies_during_the_late_reservation_and_another_takes_the_prompt():
    async def go():
        c = FakeCluster(1, 2, horizon=HORIZON)
        task, chosen = await start_deferred(c, 6)
        c[chosen].reserve_gate.clear()  # its reserve call hangs ...
        c["prefill-0"].prefill_gate.set()
        await until(lambda: c[chosen].reserve_calls)
        c.kill(chosen)  # ... and it dies under it: the prompt's stream must not take that loss for its own
        tokens, _, state = await task
        assert tokens == reference(LONG, 6) and not state.failures
        assert state.decode_worker != chosen

    run(go())


def test_draining_a_decode_worker_only_promised_a_prompt_does_not_wait_for_it():
    async def go():
        c = FakeCluster(1, 2, horizon=HORIZON)
        task, chosen = await start_deferred(c, 6)  # the prompt queues on the prefill worker for a long time
        assert await c.router.drain_worker(c.registry.get(chosen), timeout_s=0.5), "it held nothing"
        c["prefill-0"].prefill_gate.set()
        tokens, _, state = await task
        assert tokens == reference(LONG, 6) and not state.failures and state.decode_worker != chosen

    run(go())


def test_router_replicas_split_the_promise_between_them():
    from control.config import ServeConfig

    assert ServeConfig(model="tiny-random").router_config().promise_share == 1.0
    assert ServeConfig(model="tiny-random", routers=4).router_config().promise_share == 0.25
