"""The request lifecycle over fake workers: every phase × every failure, where blocks are freed and what
the client sees. No Ray and no model: each test runs in milliseconds (see tests/router/fakes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from router.lifecycle import Phase
from router.router import RouterError
from router.worker_client import Failure
from tests.router.fakes import FakeCluster, FakeWorker, reference

PROMPT = list(range(1, 23))  # 22 tokens: 6 blocks of 4


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_happy_path_streams_the_reference_and_frees_everything():
    async def go():
        c = FakeCluster(1, 1)
        tokens, finish, state = await c.collect(c.request("a", PROMPT, 12))
        await c.settle()
        assert tokens == reference(PROMPT, 12)
        assert finish == "length"
        assert state.history == [Phase.QUEUED, Phase.PREFILLING, Phase.DECODING, Phase.FINISHED]
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}
        # workers only ever see the router's attempt keys, never the client's id
        assert c["prefill-0"].keys == c["decode-0"].keys == [f"{state.id}.1"]
        assert not c.router.requests and not c.router._attempts

    run(go())


def test_first_token_that_ends_the_request_releases_the_reservation():
    async def go():
        c = FakeCluster(1, 1)
        tokens, finish, _ = await c.collect(c.request("a", PROMPT, 1))
        await c.settle()
        assert (tokens, finish) == (reference(PROMPT, 1), "length")
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}

    run(go())


# -- failures in each phase ------------------------------------------------------------------------------

async def _fail_in_decoding(c: FakeCluster, event: str, after: int = 4):
    """Run a request and inject `event` into its first attempt once the client has `after` tokens."""
    done = False

    async def on_event(n, state):
        nonlocal done
        if n >= after and not done:
            done = True
            d = c[state.decode_worker]
            if event == "decode_lost":
                c.kill(d.worker_id)
            elif event == "prefill_lost":
                c.kill(state.prefill_worker)
            elif event == "worker_error":
                d.error_next_step = True

    return await c.collect(c.request("a", PROMPT, 20), on_event)


@pytest.mark.parametrize("event", ["decode_lost", "worker_error"])
def test_decode_failure_migrates_with_no_duplicate_or_missing_token(event):
    async def go():
        c = FakeCluster(1, 2)
        tokens, finish, state = await _fail_in_decoding(c, event)
        await c.settle()
        assert tokens == reference(PROMPT, 20)
        assert finish == "length"
        assert Phase.MIGRATING in state.history
        assert [f.cause.value for f in state.failures] == [event]
        # the second attempt re-prefilled prompt + tokens streamed so far, under a fresh key
        assert len(c["prefill-0"].keys) == 2 and c["prefill-0"].keys[1] == f"{state.id}.2"
        assert all(v == 0 for v in c.blocks_in_use().values())

    run(go())


def test_prefill_loss_never_touches_a_request_decoding_elsewhere():
    async def go():
        c = FakeCluster(2, 1)
        tokens, finish, state = await _fail_in_decoding(c, "prefill_lost")
        assert tokens == reference(PROMPT, 20) and finish == "length"
        assert state.failures == [] and state.num_attempts == 1
        assert Phase.MIGRATING not in state.history

    run(go())


@pytest.mark.parametrize("event", ["prefill_lost", "prefill_call_fails", "decode_lost", "kv", "error",
                                   "reservation"])
def test_failure_before_the_first_token_is_retried_invisibly(event):
    async def go():
        c = FakeCluster(2, 2)
        task = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 8)))
        # the first attempt is prefilling on one of the prefill workers: find it, hold it there
        for w in ("prefill-0", "prefill-1"):
            c[w].prefill_gate.clear()
        while not (c["prefill-0"].prefill_started.is_set() or c["prefill-1"].prefill_started.is_set()):
            await asyncio.sleep(0.001)
        state = next(iter(c.router.requests.values()))
        assert state.phase is Phase.PREFILLING
        p, d = c[state.attempt.prefill.worker_id], c[state.attempt.decode.worker_id]
        if event == "prefill_lost":
            c.kill(p.worker_id)
        elif event == "prefill_call_fails":
            c.kill(p.worker_id, noticed=False)  # only the pending prefill call says so
        elif event == "decode_lost":
            c.kill(d.worker_id)
        elif event == "reservation":
            d.lapse_next_start = True
        else:
            p.fail_next_prefill = event
        for w in ("prefill-0", "prefill-1"):
            c[w].prefill_gate.set()
        tokens, finish, state = await task
        await c.settle()
        assert tokens == reference(PROMPT, 8) and finish == "length"
        assert state.num_attempts == 2
        assert all(v == 0 for v in c.blocks_in_use().values())

    run(go())


def test_migration_limit_ends_the_request_with_unavailable_naming_the_workers():
    async def go():
        c = FakeCluster(1, 3, migration_limit=1)
        killed = []

        async def on_event(n, state):
            if state.decode_worker not in killed:
                killed.append(state.decode_worker)
                c.kill(state.decode_worker)

        with pytest.raises(RouterError) as e:
            await c.collect(c.request("a", PROMPT, 20), on_event)
        assert e.value.code == "UNAVAILABLE"
        assert "--migration-limit 1" in str(e.value)
        for wid in killed:
            assert wid in str(e.value)
        assert "actor died" not in str(e.value)  # the workers' failure text is for the log only
        await c.settle()
        assert all(v == 0 for v in c.blocks_in_use().values())

    run(go())


# -- cancellation in each phase --------------------------------------------------------------------------

@pytest.mark.parametrize("phase", [Phase.QUEUED, Phase.PREFILLING, Phase.DECODING])
def test_cancel_in_every_phase_frees_every_block(phase):
    async def go():
        c = FakeCluster(1, 1)
        if phase is Phase.QUEUED:
            c["decode-0"].reserve_full = True  # waits in the admission queue
        if phase is Phase.PREFILLING:
            c["prefill-0"].prefill_gate.clear()
        gen = c.router.generate(c.request("a", PROMPT, 200))
        task = asyncio.ensure_future(gen.__anext__())
        while not c.router.requests or next(iter(c.router.requests.values())).phase < min(phase, Phase.PREFILLING):
            await asyncio.sleep(0.001)
        state = next(iter(c.router.requests.values()))
        if phase is Phase.DECODING:
            await task  # the first token (out before the KV lands)
            await gen.__anext__()  # the first decode step's
        else:  # the client goes away: gRPC cancels the handler's task mid-await
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await task
        await gen.aclose()
        await c.settle()
        assert state.phase is Phase.CANCELLED
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}
        assert not c.router.requests and not c.router._attempts

    run(go())


def test_a_request_id_reused_right_after_a_cancel_gets_only_its_own_tokens():
    async def go():
        c = FakeCluster(1, 1)
        c["decode-0"].step_s = 0.01
        gen = c.router.generate(c.request("same", PROMPT, 200))
        await gen.__anext__()
        await gen.__anext__()
        await gen.aclose()  # the abort to the workers is still on its way
        other = [7, 7, 7] * 5
        tokens, finish, state = await c.collect(c.request("same", other, 10))
        assert tokens == reference(other, 10) and finish == "length"
        await c.settle()
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}
        assert len(set(c["decode-0"].keys)) == 2  # two attempts, two keys, on the same worker

    run(go())


def test_a_client_id_in_flight_twice_is_refused():
    async def go():
        c = FakeCluster(1, 1)
        gen = c.router.generate(c.request("dup", PROMPT, 50))
        await gen.__anext__()
        with pytest.raises(RouterError) as e:
            await c.collect(c.request("dup", PROMPT, 5))
        assert e.value.code == "ALREADY_EXISTS"
        await gen.aclose()

    run(go())


# -- overload --------------------------------------------------------------------------------------------

def test_full_decode_pool_and_full_queue_refuse_at_once_before_any_prefill():
    async def go():
        c = FakeCluster(1, 1, max_queue=0)
        c["decode-0"].reserve_full = True
        t0 = time.monotonic()
        with pytest.raises(RouterError) as e:
            await c.collect(c.request("a", PROMPT, 5))
        assert e.value.code == "RESOURCE_EXHAUSTED" and "admission queue is full" in str(e.value)
        assert time.monotonic() - t0 < 1.0
        assert c["prefill-0"].keys == []  # never prefilled

    run(go())


def test_deep_prefill_queues_refuse_new_prompts():
    async def go():
        c = FakeCluster(1, 1, max_queued_prefill_tokens=30)
        c["prefill-0"].prefill_gate.clear()
        first = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 3)))
        while not c["prefill-0"].prefill_started.is_set():
            await asyncio.sleep(0.001)
        with pytest.raises(RouterError) as e:
            await c.collect(c.request("b", PROMPT, 3))
        assert e.value.code == "RESOURCE_EXHAUSTED" and "max-queued-prefill-tokens" in str(e.value)
        c["prefill-0"].prefill_gate.set()
        assert (await first)[0] == reference(PROMPT, 3)

    run(go())


def test_leases_are_renewed_while_the_prefill_worker_lives():
    async def go():
        c = FakeCluster(1, 1)
        c["prefill-0"].prefill_gate.clear()
        task = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 3)))
        while not c["prefill-0"].prefill_started.is_set():
            await asyncio.sleep(0.001)
        key = next(iter(c.router._attempts))
        c.router.on_heartbeat(c.registry.get("prefill-0"))
        c.router.on_heartbeat(c.registry.get("decode-0"))  # not a prefill worker: renews nothing
        await c.settle()
        assert c["decode-0"].renewed == [key]
        c["prefill-0"].prefill_gate.set()
        await task

    run(go())


def test_new_requests_wait_for_a_replacement_prefill_worker():
    async def go():
        c = FakeCluster(1, 1)
        c.kill("prefill-0")
        task = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 4)))
        await asyncio.sleep(0.1)
        assert not task.done()
        c.add(FakeWorker("prefill-1", c["prefill-0"].kind))
        tokens, _, _ = await task
        assert tokens == reference(PROMPT, 4)

    run(go())


def test_colocated_worker_loss_migrates_too():
    async def go():
        c = FakeCluster(0, 0, num_colocated=2)
        tokens, finish, state = await _fail_in_decoding(c, "decode_lost")
        assert tokens == reference(PROMPT, 20) and finish == "length"
        assert state.num_attempts == 2

    run(go())


def test_draining_router_refuses_new_requests_and_waits_for_old_ones():
    async def go():
        c = FakeCluster(1, 1)
        task = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 30)))
        while not c.router.requests:
            await asyncio.sleep(0.001)
        drained = asyncio.ensure_future(c.router.drain(5.0))
        await asyncio.sleep(0.01)
        with pytest.raises(RouterError) as e:
            await c.collect(c.request("b", PROMPT, 3))
        assert e.value.code == "UNAVAILABLE"
        assert (await task)[0] == reference(PROMPT, 30)
        assert await drained

    run(go())


def test_a_client_that_stops_reading_pauses_its_sequence_on_the_decode_worker():
    async def go():
        c = FakeCluster(1, 1, max_buffered_steps=8)
        gen = c.router.generate(c.request("slow", PROMPT, 100))
        tokens = list((await gen.__anext__())[0].token_ids)
        d = c["decode-0"]
        for _ in range(200):  # the client reads nothing: the buffer fills, the worker is told to pause
            if d.paused:
                break
            await asyncio.sleep(0.005)
        assert d.flow == [("pause", next(iter(d.paused)))]
        key = next(iter(d.paused))
        await asyncio.sleep(0.05)
        assert c.router._attempts[key].queue.qsize() <= 8 + 1  # bounded: nothing more was decoded
        async for event, _ in gen:  # the client catches up: the worker resumes, the stream completes
            tokens += event.token_ids
        assert tokens == reference(PROMPT, 100)
        assert ("resume", key) in d.flow

    run(go())


def test_a_reservation_made_after_the_client_left_is_given_back():
    async def go():
        c = FakeCluster(1, 1)
        c["decode-0"].reserve_gate.clear()  # the reserve call is slow; the client cancels meanwhile
        gen = c.router.generate(c.request("a", PROMPT, 5))
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gen.aclose()
        c["decode-0"].reserve_gate.set()  # the worker finishes the reservation anyway
        await c.settle()
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}

    run(go())


def test_a_failed_resume_is_retried_so_the_stream_never_sticks():
    async def go():
        c = FakeCluster(1, 1, max_buffered_steps=8)
        c["decode-0"].fail_next_resume = True
        gen = c.router.generate(c.request("slow", PROMPT, 60))
        tokens = list((await gen.__anext__())[0].token_ids)
        while not c["decode-0"].paused:
            await asyncio.sleep(0.005)
        async for event, _ in gen:
            tokens += event.token_ids
        assert tokens == reference(PROMPT, 60)
        assert [f for f, _ in c["decode-0"].flow] == ["pause", "resume"]  # the failed one is not counted

    run(go())


def test_a_broken_step_stream_loses_and_kills_the_worker_and_its_requests_migrate():
    async def go():
        c = FakeCluster(1, 2)
        broke = False

        async def on_event(n, state):
            nonlocal broke
            if n >= 3 and not broke:
                broke = True
                c[state.decode_worker].stream_failure = Failure.UNAVAILABLE

        tokens, finish, state = await c.collect(c.request("a", PROMPT, 20), on_event)
        assert tokens == reference(PROMPT, 20) and state.num_attempts == 2
        lost = [w for w in c.workers.values() if w.killed]
        assert len(lost) == 1 and lost[0].worker_id == state.failures[0].worker_id

    run(go())


def test_a_finished_request_sends_no_abort():
    async def go():
        c = FakeCluster(1, 1)
        aborted = []
        for w in c.workers.values():
            orig = w.abort

            async def abort(key, timeout, orig=orig, wid=w.worker_id):
                aborted.append((wid, key))
                await orig(key, timeout)

            w.abort = abort
        await c.collect(c.request("a", PROMPT, 6))
        await c.settle()
        assert aborted == []

    run(go())


@pytest.mark.parametrize("layout", [(1, 1, 0), (0, 0, 1)], ids=["disaggregated", "colocated"])
def test_a_prompt_no_worker_can_ever_hold_is_refused_not_retried(layout):
    async def go():
        c = FakeCluster(*layout)
        with pytest.raises(RouterError) as e:
            await c.collect(c.request("huge", list(range(300)), 4))  # 75 blocks of 4; a worker holds 64
        assert e.value.code == "INVALID_ARGUMENT" and str(e.value).startswith("prompt: needs")
        assert all(w.keys == [] for w in c.workers.values())  # nothing was tried anywhere

    run(go())


def test_a_loss_queued_behind_tokens_is_handled_after_them():
    """Steps waiting for a slow reader are merged into one event; a worker loss queued behind them still
    ends the attempt after those tokens, and the migrated stream is the reference."""
    async def go():
        c = FakeCluster(1, 2)
        gen = c.router.generate(c.request("a", PROMPT, 60))
        event, state = await gen.__anext__()
        tokens = list(event.token_ids)
        await asyncio.sleep(0.05)  # the reader stalls: several steps queue up
        queued = state.attempt.queue.qsize()
        c.kill(state.decode_worker)
        event, _ = await gen.__anext__()  # the queued steps, merged into one event
        tokens += event.token_ids
        assert queued >= 2 and len(event.token_ids) == queued
        async for event, _ in gen:
            tokens += event.token_ids
        assert tokens == reference(PROMPT, 60) and state.num_attempts == 2

    run(go())


def test_the_first_token_reaches_the_client_before_the_kv_lands():
    async def go():
        c = FakeCluster(1, 1)
        c["prefill-0"].kv_gate.clear()  # the first token is sampled; its KV is still on the way
        gen = c.router.generate(c.request("a", PROMPT, 6))
        event, state = await asyncio.wait_for(gen.__anext__(), 5)
        assert event.first and event.token_ids == reference(PROMPT, 1)
        assert state.phase is Phase.PREFILLING and not c["decode-0"].running  # nothing decodes yet
        c["prefill-0"].kv_gate.set()
        tokens = list(event.token_ids)
        async for event, _ in gen:
            tokens += event.token_ids
        assert tokens == reference(PROMPT, 6)
        assert state.history == [Phase.QUEUED, Phase.PREFILLING, Phase.DECODING, Phase.FINISHED]

    run(go())


def test_kv_that_differs_from_what_was_sent_is_forgotten_by_the_decode_worker_and_the_request_retried():
    async def go():
        c = FakeCluster(1, 1, verify_kv_moves=True)
        c["decode-0"].corrupt_next_check = True
        tokens, finish, state = await c.collect(c.request("a", PROMPT, 8))
        await c.settle()
        assert tokens == reference(PROMPT, 8) and finish == "length"
        assert [f.cause.value for f in state.failures] == ["kv_transfer"]
        # the first attempt's KV left the decode worker's prefix cache before it was aborted
        assert c["decode-0"].forgotten == [(f"{state.id}.1", 0)]
        checks = list(c.router.kv_checks)
        assert [ch.equal for ch in checks] == [False, True] and all(ch.start == 0 for ch in checks)
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}

    run(go())


def test_a_kv_transfer_failing_after_the_first_token_went_out_continues_after_it():
    async def go():
        c = FakeCluster(1, 1)
        c["prefill-0"].kv_gate.clear()
        c["prefill-0"].fail_next_prefill = "kv"
        task = asyncio.ensure_future(c.collect(c.request("a", PROMPT, 8)))
        while not c.router.requests or not next(iter(c.router.requests.values())).generated:
            await asyncio.sleep(0.001)
        c["prefill-0"].kv_gate.set()
        tokens, finish, state = await task
        await c.settle()
        assert tokens == reference(PROMPT, 8) and finish == "length"  # the first token once, then the rest
        assert [f.cause.value for f in state.failures] == ["kv_transfer"]
        assert c["prefill-0"].keys[1:] == [f"{state.id}.2"] and c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}

    run(go())
