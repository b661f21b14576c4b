"""The real worker roles in this process, without Ray: a PrefillWorker and a DecodeWorker over an in-process
torch (gloo) KV transport, on the tiny-random model, driven as the router drives them (`router.worker_client`)
but with asyncio calls instead of actor calls. The engines and transports are passed in."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import pytest

from decode_worker import DecodeWorker
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kv_transfer import KVTransferConfig, RendezvousServer, create_receiver, create_sender
from prefill_worker import PrefillWorker
from protocol.kinds import FinishReason, PoolKind
from protocol.messages import DestinationWanted, FirstToken, PrefillResult, StepOutput, TokenDelta

HOST = "127.0.0.1"
PROMPTS = [[(7 * i + 3) % 200 + 1 for i in range(n)] for n in (40, 17, 61)]  # 3, 2 and 4 blocks of 16
NUM_BLOCKS = 64
T = TypeVar("T")


def engine_config(max_num_batched_tokens: int = 512) -> EngineConfig:
    return EngineConfig(model="tiny-random", device="cpu", dtype="float32",
                        cache=CacheConfig(block_size=16, num_blocks=NUM_BLOCKS),
                        scheduler=SchedulerConfig(16, max_num_batched_tokens, True))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(make: Callable[[], Coroutine[Any, Any, T]], timeout: float = 120.0) -> T:
    return asyncio.run(asyncio.wait_for(make(), timeout))


@pytest.fixture(scope="module")
def rendezvous():
    server = RendezvousServer(HOST)
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int], list[int]]:
    """Greedy tokens of a single engine, by (prompt index, max_tokens)."""
    engine = LLMEngine(engine_config())
    out = {}
    for i, prompt in enumerate(PROMPTS):
        for n in (1, 6):
            req = engine.add_request(prompt, greedy(n))
            while engine.has_unfinished_requests():
                engine.step()
            out[i, n] = list(req.output_token_ids)
    return out


def kv_config(rendezvous: RendezvousServer) -> KVTransferConfig:
    return KVTransferConfig(kv_transport="torch", rendezvous_host=HOST, rendezvous_port=rendezvous.port,
                            connect_timeout_s=20.0, op_timeout_s=5.0, keepalive_s=0.25, liveness_s=5.0,
                            transfer_timeout_s=20.0)


_n = iter(range(10**6))


def make_pair(rendezvous: RendezvousServer, max_num_batched_tokens: int = 512
              ) -> tuple[PrefillWorker, DecodeWorker]:
    """A prefill and a decode worker, each with its own engine and transports, passed in."""
    n = next(_n)
    cfg, kv = engine_config(max_num_batched_tokens), kv_config(rendezvous)
    p_engine, d_engine = LLMEngine(cfg), LLMEngine(cfg)
    prefill = PrefillWorker(f"prefill-{n}", cfg, kv, engine=p_engine,
                            sender=create_sender(kv, f"prefill-{n}", p_engine.kv_cache, HOST))
    decode = DecodeWorker(f"decode-{n}", cfg, kv, engine=d_engine,
                          receiver=create_receiver(kv, f"decode-{n}", d_engine.kv_cache, HOST),
                          sender=create_sender(kv, f"decode-{n}-tx", d_engine.kv_cache, HOST))
    return prefill, decode


class Steps:
    """A decode worker's step stream, read in the background into per-request token lists."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.ended: dict[str, asyncio.Future[TokenDelta]] = {}
        self._stream: AsyncIterator[StepOutput] = worker.stream_steps()
        self._task = asyncio.get_running_loop().create_task(self._read())

    def done(self, rid: str) -> asyncio.Future[TokenDelta]:
        return self.ended.setdefault(rid, asyncio.get_running_loop().create_future())

    async def _read(self) -> None:
        async for out in self._stream:
            for d in out.deltas:
                self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
                if d.finish_reason is not None and not self.done(d.request_id).done():
                    self.done(d.request_id).set_result(d)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._stream.aclose()


async def disaggregated(prefill: PrefillWorker, decode: DecodeWorker, steps: Steps, rid: str,
                        prompt: list[int], params: SamplingParams, reserve_first: bool = True) -> list[int]:
    """One request as the router runs it: reserve on the decode worker (up front, or when the prefill worker
    asks), prefill, start decoding on the first token; returns every token."""
    src = prefill.sender.endpoint_id
    reservation = await decode.reserve(rid, prompt, params, src) if reserve_first else None
    first, asked = None, 0
    async for item in prefill.prefill(rid, prompt, params, reservation):
        if isinstance(item, DestinationWanted):
            asked += 1
            reservation = await decode.reserve(rid, prompt, params, src)
            assert await prefill.set_destination(rid, reservation)
        elif isinstance(item, FirstToken):
            first = item.token
            assert await decode.start(rid, first)
        else:
            assert isinstance(item, PrefillResult) and item.ok, item.error
            assert item.first_token == first
    assert asked == (0 if reserve_first else 1)
    delta = await asyncio.wait_for(steps.done(rid), 60)
    assert delta.finish_reason is FinishReason.LENGTH, delta.error
    return [first, *steps.tokens.get(rid, [])]


def assert_all_free(*workers: PrefillWorker | DecodeWorker) -> None:
    for w in workers:
        assert w.engine.load().free_blocks == NUM_BLOCKS, f"{w.worker_id} holds blocks still"
        assert not w.engine.requests


async def close(*workers: PrefillWorker | DecodeWorker) -> None:
    for w in workers:
        await w.shutdown()


@contextlib.asynccontextmanager
async def serving(rendezvous: RendezvousServer, max_num_batched_tokens: int = 512
                  ) -> AsyncIterator[tuple[PrefillWorker, DecodeWorker, Steps]]:
    """A prefill/decode pair and the decode worker's step stream, shut down whatever the test did."""
    prefill, decode = make_pair(rendezvous, max_num_batched_tokens)
    steps = Steps(decode)
    try:
        yield prefill, decode, steps
    finally:
        await steps.close()
        await close(prefill, decode)


async def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("reserve_first", [True, False], ids=["reserved", "destination-wanted"])
def test_prefill_to_decode_is_the_single_engine_greedy_output_and_frees_every_block(
        rendezvous, reference, reserve_first):
    async def go() -> None:
        # a small step budget: the prompts are prefilled in chunks, the destination asked for mid-prompt
        budget = 512 if reserve_first else 16
        async with serving(rendezvous, max_num_batched_tokens=budget) as (prefill, decode, steps):
            info = await prefill.info(), await decode.info()
            assert [i.kind for i in info] == [PoolKind.PREFILL, PoolKind.DECODE]
            assert info[0].destination_horizon_tokens == 2 * budget and info[1].kv_address is not None
            assert (await prefill.ping()).loop_alive and (await decode.ping()).loop_alive
            got = await asyncio.gather(*(
                disaggregated(prefill, decode, steps, f"r{i}", p, greedy(6), reserve_first)
                for i, p in enumerate(PROMPTS)))
            assert got == [reference[i, 6] for i in range(len(PROMPTS))]
            # the same prompt again: the decode worker's prefix cache holds all of its full blocks now
            again = await disaggregated(prefill, decode, steps, "again", PROMPTS[0], greedy(6), reserve_first)
            assert again == reference[0, 6]
            assert (await prefill.describe())["jobs"] == {} and (await decode.describe())["pending"] == {}
            await asyncio.sleep(0)
            await decode.report()  # (a loop round trip: the last step's bookkeeping is done)
            assert_all_free(prefill, decode)

    run(go)


def test_a_first_token_that_ends_the_request_frees_both_sides(rendezvous, reference):
    async def go() -> None:
        async with serving(rendezvous) as (prefill, decode, steps):
            assert await disaggregated(prefill, decode, steps, "one", PROMPTS[1], greedy(1)) == reference[1, 1]
            await decode.report()
            assert_all_free(prefill, decode)
            # a renewal that reaches the decode worker after the request ended (a busy router has not yet
            # seen its prefill end): it was admitted, not lapsed; an id never reserved here was
            assert await decode.renew(["one", "never"]) == ["never"]

    run(go)


def test_aborts_free_every_block_on_both_sides(rendezvous):
    async def go() -> None:
        async with serving(rendezvous, max_num_batched_tokens=16) as (prefill, decode, steps):
            # a reservation aborted before its KV came
            src = prefill.sender.endpoint_id
            assert await decode.reserve("held", PROMPTS[2], greedy(6), src) is not None
            assert (await decode.describe())["requests"] == {"held": "WAITING_FOR_KV"}
            await decode.abort("held")
            # a prompt aborted while it waits for its destination, on the prefill worker
            stream = prefill.prefill("waiting", PROMPTS[2], greedy(6), None)
            assert isinstance(await stream.__anext__(), DestinationWanted)
            await prefill.abort("waiting")
            result = await stream.__anext__()
            assert isinstance(result, PrefillResult) and result.error == "aborted by the router"
            # a sequence aborted while decoding
            params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
            reservation = await decode.reserve("long", PROMPTS[0], params, src)
            async for item in prefill.prefill("long", PROMPTS[0], params, reservation):
                if isinstance(item, FirstToken):
                    await decode.start("long", item.token)
            await wait_until(lambda: len(steps.tokens.get("long", [])) >= 3)
            await decode.abort("long")
            # a router replica gone: everything its attempts hold ends
            assert await decode.reserve("gone/a", PROMPTS[1], greedy(6), src) is not None
            assert await decode.release_router("gone") == 1
            await prefill.report()
            await decode.report()
            assert_all_free(prefill, decode)

    run(go)


def test_the_colocated_role_prefills_and_decodes_itself(reference):
    async def go() -> None:
        cfg = engine_config()
        worker = DecodeWorker("colocated", cfg, None, engine=LLMEngine(cfg))
        steps = Steps(worker)
        try:
            assert (await worker.info()).kind is PoolKind.COLOCATED
            for i, p in enumerate(PROMPTS):
                await worker.submit(f"c{i}", p, greedy(6))
            for i in range(len(PROMPTS)):
                assert (await asyncio.wait_for(steps.done(f"c{i}"), 60)).finish_reason is FinishReason.LENGTH
            assert [steps.tokens[f"c{i}"] for i in range(len(PROMPTS))] == [reference[i, 6] for i in
                                                                            range(len(PROMPTS))]
            await worker.report()
            assert_all_free(worker)
        finally:
            await steps.close()
            await close(worker)

    run(go)
