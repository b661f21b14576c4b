"""Chunked prefill, prefix caching, mixed batches and preemption all give the one-pass answer."""

from __future__ import annotations

import hashlib

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig
from engine.request import Request
from tests.engine.helpers import greedy, make_engine, rel_err, run_capturing_logits

PROMPT = [(11 * i + 5) % 250 for i in range(70)]


def one_pass_logits(prompt: list[int], max_tokens: int) -> list[torch.Tensor]:
    engine = make_engine(max_num_batched_tokens=4096, prefix_caching=False)
    req = engine.add_request(prompt, greedy(max_tokens, ignore_eos=True))
    return run_capturing_logits(engine)[req.request_id]


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_matches_one_pass(chunk):
    ref = one_pass_logits(PROMPT, 4)
    engine = make_engine(max_num_batched_tokens=chunk)
    req = engine.add_request(PROMPT, greedy(4, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        assert out.num_tokens <= chunk
        logits = engine.runner.execute(out)
        if out.chunks[0].end == req.num_tokens:
            steps.append(logits[0].clone())
        engine.scheduler.update(out, [[t] for t in logits.argmax(-1).tolist()])
    assert len(steps) == len(ref)
    for ours, want in zip(steps, ref):
        assert rel_err(ours, want) <= 1e-5


def test_prefix_cache_hit_computes_only_new_tokens_and_matches():
    engine = make_engine()
    first = engine.add_request(PROMPT[:50], greedy(2, ignore_eos=True))
    run_capturing_logits(engine)
    assert engine.allocator.num_cached_blocks >= 3  # 50 prompt tokens -> 3 full blocks

    req = engine.add_request(PROMPT, greedy(4, ignore_eos=True))
    out = engine.scheduler.schedule()
    assert req.num_cached_tokens == 48
    assert out.chunks[0].start == 48 and out.num_tokens == len(PROMPT) - 48
    logits = engine.runner.execute(out)
    engine.scheduler.update(out, [[t] for t in logits.argmax(-1).tolist()])
    rest = run_capturing_logits(engine)[req.request_id]
    ref = one_pass_logits(PROMPT, 4)
    for ours, want in zip([logits[0]] + rest, ref):
        assert rel_err(ours, want) <= 1e-5
    assert first.is_finished


def test_whole_prompt_cached_still_computes_last_token():
    engine = make_engine()
    engine.add_request(PROMPT[:64], greedy(1, ignore_eos=True))
    run_capturing_logits(engine)
    req = engine.add_request(PROMPT[:64], greedy(3, ignore_eos=True))
    out = engine.scheduler.schedule()
    assert req.num_cached_tokens == 48 and out.num_tokens == 16  # last block recomputed for its logits
    engine.scheduler.update(out, [[t] for t in engine.runner.execute(out).argmax(-1).tolist()])
    run_capturing_logits(engine)
    assert req.output_token_ids == _alone(PROMPT[:64], 3)


def _alone(prompt: list[int], n: int) -> list[int]:
    engine = make_engine(prefix_caching=False)
    req = engine.add_request(prompt, greedy(n, ignore_eos=True))
    run_capturing_logits(engine)
    return req.output_token_ids


def test_mixed_length_batch_equals_each_sequence_alone():
    prompts = [PROMPT[:n] for n in (3, 17, 40, 70, 9, 33)]
    max_tokens = [12, 5, 20, 8, 30, 1]
    engine = make_engine(max_num_batched_tokens=64)  # forces prefill chunks to share steps with decodes
    reqs = [engine.add_request(p, greedy(m, ignore_eos=True)) for p, m in zip(prompts, max_tokens)]
    logits = run_capturing_logits(engine)
    for p, m, r in zip(prompts, max_tokens, reqs):
        ref = one_pass_logits(p, m)
        assert r.output_token_ids == _alone(p, m)
        for ours, want in zip(logits[r.request_id], ref):
            assert rel_err(ours, want) <= 1e-5


@pytest.mark.parametrize("order", ["fifo", "fair"])
def test_preemption_under_block_pressure_recomputes_and_matches(order):
    prompts = [PROMPT[i:i + 20] for i in range(8)]
    want = [_alone(p, 40) for p in prompts]
    # 8 requests x 60 tokens need 32 blocks; 10 blocks force repeated preemption
    engine = make_engine(num_blocks=10, prefix_caching=False, prefill_order=order)
    reqs = [engine.add_request(p, greedy(40, ignore_eos=True)) for p in prompts]
    preempted = 0
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        preempted += len(out.preempted)
        if out.chunks:
            engine.scheduler.update(out, [[t] for t in engine.runner.execute(out).argmax(-1).tolist()])
    assert preempted > 0
    assert [r.output_token_ids for r in reqs] == want
    assert engine.allocator.num_used_blocks == 0
    engine.allocator.check_invariants()


def test_request_larger_than_the_whole_cache_ends_with_length_not_a_hang():
    engine = make_engine(num_blocks=4, prefix_caching=False)  # 64 tokens of KV in all
    req = engine.add_request(PROMPT[:40], greedy(100, ignore_eos=True))
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert req.is_finished and req.finish_reason.value == "length"
    assert len(req.output_token_ids) == 64 - 40 + 1
    assert engine.allocator.num_used_blocks == 0


def test_abort_frees_blocks_and_prefix_cache_keeps_full_blocks():
    engine = make_engine()
    req = engine.add_request(PROMPT, greedy(50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.allocator.num_used_blocks == 5
    engine.abort_request(req.request_id)
    assert req.finish_reason.value == "abort"
    assert engine.allocator.num_used_blocks == 0
    assert engine.allocator.num_cached_blocks == 4
    assert not engine.has_unfinished_requests()


def test_a_paused_sequence_keeps_its_blocks_and_resumes_where_it_was():
    ref = make_engine()
    want = ref.add_request(PROMPT, greedy(12, ignore_eos=True))
    while ref.has_unfinished_requests():
        ref.step()
    engine = make_engine()
    req = engine.add_request(PROMPT, greedy(12, ignore_eos=True))
    other = engine.add_request(PROMPT[:20], greedy(30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    held = list(req.block_ids)
    assert engine.scheduler.pause(req.request_id)
    for _ in range(5):
        _, advanced = engine.step()
        assert req not in advanced  # no token while paused
    assert req.block_ids == held and len(req.output_token_ids) == 4
    assert engine.scheduler.resume(req.request_id)
    while not req.is_finished:
        engine.step()
    assert req.output_token_ids == want.output_token_ids
    assert engine.scheduler.pause(other.request_id)
    engine.abort_request(other.request_id)  # aborting a paused sequence frees its blocks
    assert not engine.scheduler.paused and engine.allocator.num_free_blocks == engine.allocator.num_blocks


LONG = [(7 * i + 3) % 250 for i in range(300)]


@pytest.mark.parametrize("order", ["fifo", "fair"])
def test_a_short_prompt_behind_a_long_one_waits_one_step_in_fair_order(order):
    engine = make_engine(max_num_batched_tokens=64, prefill_order=order)
    long = engine.add_request(LONG, greedy(4, ignore_eos=True))
    engine.step()  # the long prompt's first chunk: it is prefilling now
    short = engine.add_request(PROMPT[:10], greedy(4, ignore_eos=True))
    out = engine.scheduler.schedule()
    got = {c.request.request_id: c.num_tokens for c in out.chunks}
    if order == "fair":  # the short prompt first, the long one chunked to what is left
        assert got == {short.request_id: 10, long.request_id: 54}
    else:  # FIFO: the long prompt keeps the whole budget until it is done
        assert got == {long.request_id: 64}
    engine.scheduler.update(out, [[t] for t in engine.runner.execute(out).argmax(-1).tolist()])
    while engine.has_unfinished_requests():
        engine.step()
    assert long.output_token_ids == _alone(LONG, 4) and short.output_token_ids == _alone(PROMPT[:10], 4)
    assert engine.allocator.num_used_blocks == 0


def test_fair_order_ages_a_long_prompt_ahead_of_newer_short_ones():
    engine = make_engine(max_num_batched_tokens=64, prefill_order="fair")
    long = engine.add_request(LONG, greedy(1, ignore_eos=True))
    shorts = [engine.add_request(PROMPT[i:i + 12], greedy(1, ignore_eos=True)) for i in range(3)]
    out = engine.scheduler.schedule()
    assert [c.request for c in out.chunks] == shorts + [long]  # fewest tokens first; the long takes the rest
    engine.scheduler.update(out, [[t] for t in engine.runner.execute(out).argmax(-1).tolist()])
    # 272 tokens left, 64 tokens of credit per step waited: a short prompt that arrived just now still goes
    # first, but after 5 steps of waiting (320 tokens of credit) the long one outranks a new short prompt and
    # takes the whole step
    newer = engine.add_request(PROMPT[20:32], greedy(1, ignore_eos=True))
    out = engine.scheduler.schedule()
    assert [c.request for c in out.chunks] == [newer, long]
    engine.scheduler.update(out, [[t] for t in engine.runner.execute(out).argmax(-1).tolist()])
    engine.scheduler._step += 3  # three steps pass (as they would on a busy worker's decode rows)
    last = engine.add_request(PROMPT[30:42], greedy(1, ignore_eos=True))
    out = engine.scheduler.schedule()
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(long, 64)]
    assert last in engine.scheduler.waiting


def test_fair_order_caps_a_steps_prompt_tokens_so_a_step_stays_short():
    engine = LLMEngine(EngineConfig(model="tiny-random", device="cpu", dtype="float32",
                                    cache=CacheConfig(block_size=16, num_blocks=256),
                                    scheduler=SchedulerConfig(64, 256, prefill_order="fair", prefill_chunk_tokens=64)))
    long = engine.add_request(LONG, greedy(2, ignore_eos=True))
    assert [c.num_tokens for c in engine.step()[0].chunks] == [64]  # alone, it still takes only its cap
    shorts = [engine.add_request(PROMPT[i:i + 30], greedy(2, ignore_eos=True)) for i in range(2)]
    out, _ = engine.step()
    # all prompts together take at most the cap: the short ones first, the long one what is left
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(shorts[0], 30), (shorts[1], 30), (long, 4)]
    second = engine.add_request(LONG[::-1], greedy(2, ignore_eos=True))
    out, _ = engine.step()
    prompts = [(c.request, c.num_tokens) for c in out.chunks if c.request not in shorts]  # (shorts: decoding)
    assert prompts == [(long, 64)]  # two long prompts: still 64 in all, the one with fewer left first
    assert second in engine.scheduler.waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert long.output_token_ids == _alone(LONG, 2)


def test_a_sequence_whose_kv_came_from_elsewhere_ages_like_any_prompt_once_preempted():
    """A decode worker's sequence starts from `reserve_for_kv`, not `add`: preempted, it waits in fair order
    with the age it had, so newer prompts cannot pass it forever."""
    engine = make_engine(max_num_batched_tokens=64, prefill_order="fair")
    sched = engine.scheduler
    moved = Request("moved", LONG[:200], greedy(4, ignore_eos=True), 16)
    assert sched.reserve_for_kv(moved) is not None
    sched.kv_landed(moved, 7)
    sched.running.remove(moved)
    sched._preempt(moved)  # (as block pressure would)
    sched._step += 5  # it has waited: 6 steps by the next one, 384 tokens of credit against its 201
    short = engine.add_request(PROMPT[:12], greedy(1, ignore_eos=True))
    out = sched.schedule()
    assert [c.request for c in out.chunks][:2] == [moved, short]  # the older first, though it is longer


def test_received_kv_that_failed_its_check_leaves_the_prefix_cache_and_is_never_registered_again():
    engine = make_engine()
    first = Request("first", LONG[:100], greedy(40, ignore_eos=True), 16)
    assert engine.reserve_for_kv(first) is not None
    engine.kv_landed(first, 7)
    hashes = first.block_hashes[:6]
    assert engine.allocator.find_cached(hashes) == first.block_ids[:6]  # landed: its full blocks are shared
    assert engine.forget_kv("first", 32)  # (the check compared from position 32: 2 blocks came from cache)
    assert engine.allocator.find_cached(hashes) == first.block_ids[:2]
    for _ in range(20):  # decoding fills more blocks: none of them is registered either
        engine.step()
    assert len(first.block_hashes) > 6 and engine.allocator.num_cached_blocks == 2
    engine.abort_request("first")
    engine.allocator.check_invariants()
    # the next prompt over the same tokens reuses only the 2 blocks that were not received
    again = Request("again", LONG[:100], greedy(1), 16)
    engine.reserve_for_kv(again)
    assert again.num_cached_tokens == 32
    assert not engine.forget_kv("nobody", 0)


def test_a_step_reports_what_it_computed_and_shares_its_time_among_the_prompts_it_computed():
    engine = make_engine(max_num_batched_tokens=64)
    decoding = engine.add_request(PROMPT[40:60], greedy(8, ignore_eos=True))  # shares no block with PROMPT
    engine.step()  # its prompt, alone
    assert engine.last_step.num_prefill_tokens == 20 and engine.last_step.num_decode_seqs == 0
    assert decoding.prefill_compute_s == pytest.approx(engine.last_step.seconds)
    own = decoding.prefill_compute_s
    long = engine.add_request(PROMPT, greedy(1, ignore_eos=True))
    short = engine.add_request(PROMPT[:10][::-1], greedy(1, ignore_eos=True))
    shares = {long.request_id: 0.0, short.request_id: 0.0}
    while not (long.output_token_ids and short.output_token_ids):  # FIFO: 63 prompt tokens + 1 decode row a step
        out, _ = engine.step()
        st = engine.last_step
        assert st.num_decode_seqs == 1 and st.num_prefill_tokens == out.num_tokens - 1
        for c in out.chunks:
            if c.request.request_id in shares:
                shares[c.request.request_id] += st.seconds * c.num_tokens / out.num_tokens
    assert long.prefill_compute_s == pytest.approx(shares[long.request_id])
    assert short.prefill_compute_s == pytest.approx(shares[short.request_id])
    assert 0 < short.prefill_compute_s < long.prefill_compute_s
    assert decoding.prefill_compute_s == own  # its decode rows add nothing to its prompt's time


@pytest.mark.parametrize("order", ["fifo", "fair"])
def test_a_prompt_awaiting_its_kv_destination_computes_all_but_its_last_chunk_and_others_go_on(order):
    engine = make_engine(max_num_batched_tokens=32, prefill_order=order)
    held = Request("held", PROMPT, greedy(1), 16, prefill_only=True, awaiting_destination=True)
    engine.scheduler.add(held)
    other = engine.add_request(PROMPT[::-1], greedy(3, ignore_eos=True))
    for _ in range(12):
        engine.step()
    assert held.num_computed_tokens == len(PROMPT) - 1 and not held.output_token_ids  # held short of the end
    assert len(other.output_token_ids) == 3  # the other request was never blocked behind it
    held.awaiting_destination = False  # the decode blocks are reserved: the last chunk may run
    out, advanced = engine.step()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("held", 1)]
    assert advanced == [held] and len(held.output_token_ids) == 1


@pytest.mark.parametrize("order", ["fifo", "fair"])
def test_prompts_held_for_their_kv_destination_never_keep_another_prompt_out_of_a_full_cache(order):
    """A held prompt cannot use its blocks until a decode worker has room, and that room may be what a prompt
    queued behind it holds reserved: a full cache must not stall the worker behind it (in FIFO order the
    waiting prompt's admission preempts it; in fair order it is the last victim)."""
    engine = make_engine(num_blocks=8, max_num_batched_tokens=32, prefill_order=order)
    held = Request("held", PROMPT, greedy(1), 16, prefill_only=True, awaiting_destination=True)
    engine.scheduler.add(held)
    for _ in range(4):
        engine.step()
    assert held.num_computed_tokens == len(PROMPT) - 1  # 5 of the 8 blocks
    other = engine.add_request(PROMPT[::-1], greedy(3, ignore_eos=True))
    for _ in range(40):
        engine.step()
    assert len(other.output_token_ids) == 3, "the other prompt was kept out behind the held one"
    held.awaiting_destination = False  # its destination came: it is recomputed if it was preempted, and ends
    for _ in range(10):
        engine.step()
    assert len(held.output_token_ids) == 1


def test_fair_order_computes_a_higher_priority_class_first():
    engine = make_engine(max_num_batched_tokens=64, prefill_order="fair")
    low = engine.add_request(PROMPT[:12], greedy(1, ignore_eos=True))
    high = engine.add_request(LONG, greedy(1, ignore_eos=True, priority=5))
    out = engine.scheduler.schedule()
    # the short low-class prompt would go first by size; the class outranks it and takes the whole step
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(high, 64)]
    assert low in engine.scheduler.waiting


def test_lower_classes_take_smaller_steps_while_a_higher_class_is_recent_and_the_whole_step_otherwise():
    engine = make_engine(max_num_batched_tokens=64, prefill_order="fair", lower_class_chunk_tokens=16,
                         priority_memory_steps=3)

    def prompt_tokens(req: Request) -> list[int]:
        steps = []
        while not req.output_token_ids:
            out = engine.step()[0]
            steps.append(sum(c.num_tokens for c in out.chunks if c.request is req))
        return steps

    # one class only (as when no request asks for a priority): whole steps
    assert prompt_tokens(engine.add_request(LONG[::-1][:200], greedy(1, ignore_eos=True))) == [64, 64, 64, 8]
    low = engine.add_request(LONG, greedy(1, ignore_eos=True))
    high = engine.add_request(PROMPT[:40], greedy(1, ignore_eos=True, priority=5))
    out = engine.step()[0]
    # the high class goes first, the low one takes at most its share of what is left
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(high, 40), (low, 16)]
    # the high class ended; for `priority_memory_steps` steps the low one still takes small ones, then whole
    assert prompt_tokens(low) == [16, 16, 16, 64, 64, 64, 44]


def test_fifo_order_admits_a_higher_priority_class_first_and_by_arrival_within_a_class():
    engine = make_engine(max_num_batched_tokens=64, prefill_order="fifo", max_num_seqs=1)
    first = engine.add_request(PROMPT[:12], greedy(1, ignore_eos=True))
    second = engine.add_request(PROMPT[:14], greedy(1, ignore_eos=True))
    high = engine.add_request(LONG, greedy(1, ignore_eos=True, priority=5))
    admitted = []
    for _ in range(20):
        out = engine.scheduler.schedule()
        admitted += [c.request for c in out.chunks if c.start == 0]
        engine.scheduler.update(out, [[0] for _ in out.chunks])
    assert admitted == [high, first, second]  # the class outranks arrival; within a class, arrival order


def test_kv_read_from_a_position_on_equals_the_whole_read_sliced_there_and_so_does_its_digest():
    engine = make_engine()
    req = engine.add_request(LONG[:70], greedy(40, ignore_eos=True))
    for _ in range(10):
        engine.step()
    rid = req.request_id
    whole = engine.kv_of(rid, 70)
    for start in (0, 5, 16, 37, 64, 69):  # inside the first block, on a boundary, across, in the last
        part = engine.kv_of(rid, 70, start)
        assert part.shape[2] == 70 - start and torch.equal(part, whole[:, :, start:])
    assert engine.kv_digest(rid, 70, 37) == hashlib.sha256(
        whole[:, :, 37:].contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    assert engine.kv_of(rid, 10_000) is None and engine.kv_of("nobody", 1) is None
