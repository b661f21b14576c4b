"""Per-request phase placement (router.placement.choose_path over router.cost_model.CostModel): each
decision on load snapshots, with the costs it is made from."""

from __future__ import annotations

import asyncio

import pytest

from protocol import Path
from protocol.block_hash import hash_blocks
from router.cost_model import CostModel, CostPriors
from router.observer import RequestObserver
from router.placement import choose_path
from router.prefix_index import PrefixIndex
from tests.router.fakes import FakeCluster
from tests.router.fakes import reference as fake_reference
from tests.router.test_placement import BS, decode, prefill

BYTES_PER_TOKEN = 46_080  # SmolLM2-135M, fp32: 30 layers x K and V x 3 heads x 64 x 4 bytes


def model(prefill_rate: float = 400.0, step_s: float = 0.06, **links: float) -> CostModel:
    """A model as if these had been measured: every worker prefills at `prefill_rate` tokens/s and steps in
    `step_s`; `links` maps 'p0_d0' to a pair's bytes/s."""
    cost = CostModel(BYTES_PER_TOKEN)
    for w in ("p0", "p1", "d0", "d1"):
        cost.observe_prefill(w, 4000, 4000 / prefill_rate)
        cost.observe_step(w, step_s)
    for pair, rate in links.items():
        src, dst = pair.split("_")
        cost.observe_transfer(src, dst, 10**8, 10**8 / rate)
    return cost


def prompt(n: int, base: int = 7) -> list[int]:
    return [base + i for i in range(n)]


def choose(tokens: list[int], prefills, decodes, cost: CostModel, index: PrefixIndex | None = None, **kw):
    hashes = hash_blocks(tokens, BS)
    need = -(-len(tokens) // BS)
    return choose_path(hashes, len(tokens), BS, prefills, decodes, index or PrefixIndex(), cost, need, **kw)


def test_a_short_uncached_prompt_is_prefilled_on_its_decode_worker():
    cost = model()  # 400 tokens/s x 60 ms: the decode worker may prefill 24 tokens itself
    assert cost.local_budget_tokens("d0") == 24
    best = choose(prompt(20), [prefill("p0")], [decode("d0")], cost)[0]
    assert (best.path, best.decode) == (Path.LOCAL, "d0")
    best = choose(prompt(200), [prefill("p0")], [decode("d0")], cost)[0]
    assert (best.path, best.prefill, best.decode) == (Path.REMOTE, "p0", "d0")


def test_the_local_budget_comes_from_measured_costs_not_a_constant():
    slow, fast = model(prefill_rate=400.0), model(prefill_rate=20_000.0)  # a CPU and a GPU, say
    p = prompt(600)
    assert choose(p, [prefill("p0")], [decode("d0")], slow)[0].path is Path.REMOTE
    assert choose(p, [prefill("p0")], [decode("d0")], fast)[0].path is Path.LOCAL  # 1,200 tokens fit a step


def test_a_prompt_the_decode_worker_already_caches_stays_local():
    cost = model()
    tokens = prompt(16 * 20 + 5)  # 20 full blocks + 5 tokens
    index = PrefixIndex()
    index.apply("d0", hash_blocks(tokens, BS)[:20], [])  # the agent's previous turn decoded there
    best = choose(tokens, [prefill("p0")], [decode("d0"), decode("d1")], cost, index)[0]
    assert (best.path, best.decode, best.prefill_cached_blocks) == (Path.LOCAL, "d0", 20)


def test_local_is_off_when_asked():
    assert all(c.path is Path.REMOTE
               for c in choose(prompt(20), [prefill("p0")], [decode("d0")], model(), local=False))


def test_the_joint_choice_avoids_a_measured_slow_link():
    tokens = prompt(1000)
    pools = [prefill("p0", "n0"), prefill("p1", "n1", queued_prefill_tokens=200)], [decode("d0", "n1")]
    # unmeasured: p0's empty queue outweighs the node prior (cross-node 0.2 GB/s: 0.23 s for this prompt)
    unmeasured = CostModel(BYTES_PER_TOKEN, CostPriors(prefill_tokens_per_s=400.0, decode_step_s=0.06))
    assert choose(tokens, *pools, unmeasured, local=False)[0].prefill == "p0"
    # measured: the p0 -> d0 link moves 10 MB/s (4.6 s for this prompt's KV): p1 is worth its queue
    best = choose(tokens, *pools, model(p0_d0=1e7, p1_d0=1e8), local=False)[0]
    assert (best.prefill, best.decode) == ("p1", "d0")


def test_the_pair_trades_the_prefill_queue_against_the_link():
    cost = model(p0_d0=1e9, p1_d0=1e9)
    tokens = prompt(400)
    busy, idle = prefill("p0", queued_prefill_tokens=4000), prefill("p1")
    best = choose(tokens, [busy, idle], [decode("d0")], cost, local=False)[0]
    assert best.prefill == "p1"
    # estimates are in seconds: 400 tokens at 400 tokens/s + 400 x 46 KB at 1 GB/s + one 60 ms step
    assert best.estimate_s == pytest.approx(1.0 + 400 * BYTES_PER_TOKEN / 1e9 + 0.06)


def test_decode_workers_without_room_are_not_options():
    tokens = prompt(200)  # 13 blocks
    assert choose(tokens, [prefill("p0")], [decode("d0", free=12)], model()) == []
    options = choose(tokens, [prefill("p0")], [decode("d0", free=12), decode("d1", free=13)], model())
    assert {c.decode for c in options} == {"d1"}


def test_the_model_learns_and_forgets():
    cost = CostModel(BYTES_PER_TOKEN, CostPriors(alpha=0.5))
    assert cost.prefill_rate("p0") == CostPriors().prefill_tokens_per_s  # the prior, until measured
    cost.observe_prefill("p0", 1000, 1.0)
    cost.observe_prefill("p0", 8, 1.0)  # too small to measure throughput: ignored
    assert cost.prefill_rate("p0") == 1000
    cost.observe_prefill("p0", 3000, 1.0)
    assert cost.prefill_rate("p0") == pytest.approx(3500 / 1.5)  # weighted sums: (0.5 x 1000 + 3000) tokens
    assert cost.prefill_rate("p1") == cost.prefill_rate("p0")  # unmeasured: the measured workers' mean
    # a long observation weighs as much as its seconds: one quick noisy prompt cannot swing the rate
    cost.observe_prefill("p0", 2000, 2.0)
    cost.observe_prefill("p0", 100, 0.01)  # 10,000 tokens/s for 10 ms (a mean of rates would jump to ~6,000)
    assert cost.prefill_rate("p0") == pytest.approx((0.25 * 3500 + 0.5 * 2000 + 100) / (0.25 * 1.5 + 0.5 * 2 + 0.01))
    assert cost.prefill_rate("p0") < 1500
    assert cost.link_rate("p0", "d0", same_node=True) > cost.link_rate("p0", "d0", same_node=False)
    cost.observe_transfer("p0", "d0", 10**5, 0.001)  # too small to measure bandwidth: ignored
    assert cost.measured().link_bytes_per_s == {}
    cost.observe_transfer("p0", "d0", 10**7, 0.1)
    assert cost.link_rate("p0", "d0", same_node=False) == 1e8  # measured beats the node prior
    cost.forget("d0")
    assert cost.measured().link_bytes_per_s == {}


def test_a_backed_up_prefill_pool_sends_a_longer_prompt_local_when_the_saving_outweighs_the_stall():
    cost = model()  # 400 tokens/s, 60 ms steps: one step's worth is 24 tokens
    tokens = prompt(128)  # a 0.32 s stall for the decode worker's streams
    idle_pool = [prefill("p0")]
    backed_up = [prefill("p0", queued_prefill_tokens=2048)]  # 5 s of long prompts ahead of it
    assert choose(tokens, idle_pool, [decode("d0", num_running=4)], cost)[0].path is Path.REMOTE
    best = choose(tokens, backed_up, [decode("d0", num_running=4)], cost)[0]
    assert best.path is Path.LOCAL  # saves ~5 s for 4 x 0.32 s of stall
    # a decode worker running many streams is not worth stalling for the same saving
    assert choose(tokens, backed_up, [decode("d0", num_running=40)], cost)[0].path is Path.REMOTE


def test_a_chunked_local_prefill_stalls_each_step_by_at_most_one_step_and_costs_a_step_per_chunk():
    cost = model()  # 400 tokens/s, 60 ms steps
    tokens = prompt(200)
    backed_up = [prefill("p0", queued_prefill_tokens=2048)]
    busy = [decode("d0", num_running=40)]
    # whole, the 0.5 s prefill would stall 40 streams at once: not worth it
    assert choose(tokens, backed_up, busy, cost)[0].path is Path.REMOTE
    # in 20-token chunks (50 ms each, under one 60 ms step) it rides 10 of the worker's steps: allowed,
    # and its estimate counts those steps
    best = choose(tokens, backed_up, busy, cost, local_chunk_tokens=20)[0]
    assert best.path is Path.LOCAL and best.estimate_s == pytest.approx(200 / 400 + 10 * 0.06)
    # on an idle prefill pool the transfer is still cheaper than ten steps
    assert choose(tokens, [prefill("p0")], busy, cost, local_chunk_tokens=20)[0].path is Path.REMOTE


def test_a_decode_step_is_fitted_against_its_batch_and_priced_at_the_batch_a_request_joins():
    cost = CostModel(BYTES_PER_TOKEN)
    for _ in range(20):  # 30 ms at one sequence, 70 ms at nine: 5 ms per sequence
        cost.observe_step("d0", 0.03, 1)
        cost.observe_step("d0", 0.07, 9)
    assert cost.step_time("d0", 5) == pytest.approx(0.05)
    assert cost.step_time("d0", 17) == pytest.approx(0.11)
    assert cost.measured().decode_step_per_seq_s["d0"] == pytest.approx(0.005)
    cost.observe_step("d1", 0.04, 3)  # one batch size seen: no slope to tell, the mean at any batch
    assert cost.step_time("d1", 30) == 0.04
    # noise that slopes downwards is no reason to price a busier worker cheaper
    cost.observe_step("d2", 0.05, 1)
    cost.observe_step("d2", 0.04, 8)
    assert cost.step_time("d2", 8) == cost.step_time("d2", 1) == pytest.approx((0.95 * 0.05 + 0.04) / 1.95)


def test_a_step_that_carried_a_prompt_chunk_prices_the_chunk_and_is_not_fitted_as_a_decode_step():
    cost = CostModel(BYTES_PER_TOKEN)
    for _ in range(50):  # 30 ms at one sequence, 70 ms at nine
        cost.observe_step("d0", 0.03, 1)
        cost.observe_step("d0", 0.07, 9)
    cost.observe_step("d0", 0.05 + 0.064, 5, num_prefill_tokens=64)  # a 64-token chunk added 64 ms at 5
    assert cost.step_time("d0", 5) == pytest.approx(0.05)  # the decode fit did not see it
    assert cost.prefill_rate("d0") == pytest.approx(1000)  # the chunk's own cost, not the whole step's
    assert cost.local_budget_tokens("d0") == pytest.approx(1000 * cost.step_time("d0"), abs=1)
    cost.observe_step("d0", 0.045, 5, num_prefill_tokens=64)  # faster than the fit's decode step: noise
    assert cost.prefill_rate("d0") == pytest.approx(1000)
    # a worker not yet seen decoding: the whole step is the chunk's, and still no decode step is fitted
    cost.observe_step("d1", 0.1, 3, num_prefill_tokens=100)
    assert cost.prefill_rate("d1") == pytest.approx(1000)
    assert "d1" not in cost.measured().decode_step_s


def test_a_decode_worker_is_priced_at_the_batch_it_runs_now_not_the_batches_it_ran_lately():
    cost = model(prefill_rate=4000.0)
    for _ in range(20):
        cost.observe_step("d0", 0.03, 1)  # d0 ran at 1 and 41 sequences: 130 ms on average, 35 ms at 2
        cost.observe_step("d0", 0.23, 41)
        cost.observe_step("d1", 0.08, 1)  # d1: 80 ms at any batch it ran
    # both idle now: d0's step with this request is the cheaper one, though its mean is not
    best = choose(prompt(64), [prefill("p0")], [decode("d0"), decode("d1")], cost, local=False)[0]
    assert best.decode == "d0"
    assert cost.measured().decode_step_s["d0"] > cost.measured().decode_step_s["d1"]


def test_a_new_decode_worker_is_priced_as_its_fastest_measured_peer_at_its_own_batch_and_takes_traffic():
    cost = CostModel(BYTES_PER_TOKEN)
    cost.observe_prefill("p0", 4000, 1.0)
    for _ in range(20):  # d0 steps in 20 ms alone, 30 ms at five: faster than the 50 ms prior
        cost.observe_step("d0", 0.02, 1)
        cost.observe_step("d0", 0.03, 5)
        cost.observe_step("d1", 0.05, 3)  # d1: slow and busy
    assert cost.step_time("d2", 1) == pytest.approx(cost.step_time("d0", 1))  # d2 has not stepped yet
    assert cost.step_time("d2") == pytest.approx(cost.step_time("d0"))
    tokens = prompt(40)
    index = PrefixIndex()
    index.apply("d0", hash_blocks(tokens, BS)[:2], [])  # d0 even holds the prompt's prefix
    busy, slow, new = decode("d0", num_running=3), decode("d1", num_running=3), decode("d2")
    best = choose(tokens, [prefill("p0")], [busy, slow, new], cost, index, local=False)[0]
    assert best.decode == "d2"  # idle beats a busy worker that steps as fast: scaling out takes load
    assert CostModel(BYTES_PER_TOKEN).step_time("d2", 1) == CostPriors().decode_step_s  # nothing measured yet


def test_among_near_equal_estimates_the_less_loaded_decode_worker_goes_first():
    # the scale-out case: d0 has only ever run 3 sequences (no slope to tell), d1 has just started and its
    # first steps read a hair slower (a cold cache); within the estimates' noise the idle worker goes first,
    # or a worker just scaled out would never take its share
    cost = CostModel(BYTES_PER_TOKEN)
    cost.observe_prefill("p0", 4000, 1.0)
    for _ in range(20):
        cost.observe_step("d0", 0.030, 3)
        cost.observe_step("d1", 0.031, 1)
    busy, new = decode("d0", num_running=3), decode("d1")
    options = choose(prompt(40), [prefill("p0")], [busy, new], cost, local=False)
    by_decode = {o.decode: o.estimate_s for o in options}
    assert by_decode["d0"] < by_decode["d1"] <= by_decode["d0"] * 1.1
    assert options[0].decode == "d1"


# -- the router on each path, over fake workers ---------------------------------------------------------


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class Placements(RequestObserver):
    def __init__(self) -> None:
        self.paths: list[str] = []

    def on_placement(self, path: str) -> None:
        self.paths.append(path)


def test_a_short_prompt_is_prefilled_by_its_decode_worker_with_no_transfer():
    async def go():
        c = FakeCluster(1, 1, local_prefill=True)
        obs = c.router.observer = Placements()
        short = [5, 6, 7, 8, 9]  # fits one decode step's worth of prefill
        tokens, finish, state = await c.collect(c.request("a", short, 6))
        await c.settle()
        assert (tokens, finish) == (fake_reference(short, 6), "length")
        assert obs.paths == ["local"] and state.placement == "local"
        assert state.prefill_worker == state.decode_worker == "decode-0" and state.pool == "decode"
        assert not c["prefill-0"].keys  # the prefill pool never saw it
        assert c.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}

    _run(go())


def test_a_long_prompt_still_goes_to_the_prefill_pool():
    async def go():
        c = FakeCluster(1, 1, local_prefill=True)
        c.router.cost.observe_step("decode-0", 0.001)  # a fast decode step: only a few tokens fit it
        obs = c.router.observer = Placements()
        long = list(range(1, 200))
        tokens, _, state = await c.collect(c.request("a", long, 4))
        assert tokens == fake_reference(long, 4)
        assert obs.paths == ["remote"] and state.placement == "remote" and c["prefill-0"].keys

    _run(go())


def test_a_locally_prefilled_request_migrates_when_its_decode_worker_dies():
    async def go():
        c = FakeCluster(1, 2, local_prefill=True)
        short = [5, 6, 7, 8, 9]
        killed = False

        async def on_event(n, state):
            nonlocal killed
            if n >= 3 and not killed:
                killed = True
                c.kill(state.decode_worker)

        tokens, finish, state = await c.collect(c.request("a", short, 12), on_event)
        assert (tokens, finish) == (fake_reference(short, 12), "length")
        assert [f.cause.value for f in state.failures] == ["decode_lost"]

    _run(go())


def test_separate_placement_never_prefills_locally():
    async def go():
        c = FakeCluster(1, 1, local_prefill=True, placement="separate")
        obs = c.router.observer = Placements()
        await c.collect(c.request("a", [5, 6, 7], 4))
        assert obs.paths == ["remote"] and c["prefill-0"].keys

    _run(go())


def test_a_cold_worker_does_not_look_faster_than_the_one_caching_the_prefix():
    """The first prefill on a CPU measured 40 tokens/s; the other worker is unmeasured. Its stand-in is that
    measured rate, not the optimistic prior, so the cached prefix wins."""
    cost = CostModel(BYTES_PER_TOKEN)
    cost.observe_prefill("p0", 77, 77 / 40)
    tokens = prompt(77)
    index = PrefixIndex()
    index.apply("p0", hash_blocks(tokens, BS)[:4], [])
    best = choose(tokens, [prefill("p0"), prefill("p1")], [decode("d0")], cost, index)[0]
    assert (best.prefill, best.prefill_cached_blocks) == ("p0", 4)


def test_estimates_within_the_measurements_scatter_go_to_the_worker_caching_the_prefix():
    """A fast GPU-like rate makes the cached prefix save only a little; a 5% slower measurement of the
    caching worker must not send the prompt to a cold one. A clearly slower one (queue) still loses."""
    cost = CostModel(BYTES_PER_TOKEN)
    cost.observe_prefill("p0", 4000, 4000 / 6000)
    cost.observe_prefill("p1", 4000, 4000 / 6300)
    tokens = prompt(98)
    index = PrefixIndex()
    index.apply("p0", hash_blocks(tokens, BS)[:6], [])
    best = choose(tokens, [prefill("p0"), prefill("p1")], [decode("d0")], cost, index, local=False)[0]
    assert (best.prefill, best.prefill_cached_blocks) == ("p0", 6)
    busy = choose(tokens, [prefill("p0", queued_prefill_tokens=2000), prefill("p1")], [decode("d0")], cost, index,
                  local=False)[0]
    assert busy.prefill == "p1"
