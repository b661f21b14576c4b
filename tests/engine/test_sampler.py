"""Seeded sampling is a pure function of (seed, position): batch neighbours and migration don't change it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import draw_seed, sample

VOCAB = 320


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", num_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def other_worker() -> LLM:
    # NOTE: a second engine with a cold cache (no prefix caching) stands in for the worker a request
    # migrates to, so nothing carries over but the prompt and the sampling params.
    return LLM("tiny-random", num_blocks=256, max_model_len=256, enable_prefix_caching=False, seed=123)


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_draw_seed_is_pure_in_range_and_spreads():
    assert draw_seed(7, 100) == draw_seed(7, 100)
    keys = {draw_seed(s, p) for s in (0, 1, 2, 2**32 + 1, 2**70) for p in range(200)}
    assert len(keys) == 5 * 200  # no collisions, large seeds included
    assert all(0 <= k < 2**63 for k in keys)


def test_same_seed_and_position_same_token_whatever_the_batch():
    row = _logits(1, 0)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = sample(row, [seeded], [17])
    for batch_seed, size in ((1, 4), (2, 9)):
        others = _logits(size - 1, batch_seed)
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                  SamplingParams(temperature=0.7, seed=42)] * size
        for at in (0, size - 1):
            logits = torch.cat([others[:at], row, others[at:]])
            ps = params[:size - 1]
            ps.insert(at, seeded)
            positions = [17 + i for i in range(size)]
            positions[at] = 17
            # draw from the global RNG in between: seeded rows must not notice
            torch.rand(3)
            assert sample(logits, ps, positions)[at] == alone[0]


def test_seeded_draw_depends_on_position_and_seed():
    logits = torch.zeros(1, VOCAB)  # uniform: every token is as likely
    p = SamplingParams(temperature=1.0, seed=3)
    by_position = [sample(logits, [p], [pos])[0] for pos in range(64)]
    assert len(set(by_position)) > 32
    by_seed = [sample(logits, [SamplingParams(temperature=1.0, seed=s)], [5])[0] for s in range(64)]
    assert len(set(by_seed)) > 32


def test_unseeded_rows_use_fresh_randomness():
    logits = torch.zeros(1, VOCAB)
    p = SamplingParams(temperature=1.0)
    draws = [sample(logits, [p], [9])[0] for _ in range(64)]
    assert len(set(draws)) > 32


@pytest.mark.parametrize("k", [1, 5, 11])
def test_migrated_request_continues_with_the_same_tokens(llm, other_worker, k):
    total = 16
    prompt = llm.tokenizer.encode("migrate me, please")
    params = dict(temperature=0.9, top_k=50, seed=2024, ignore_eos=True)
    full = llm.generate([prompt], SamplingParams(max_tokens=total, **params))[0].token_ids
    assert len(full) == total
    migrated = other_worker.generate([prompt + full[:k]], SamplingParams(max_tokens=total - k, **params))
    assert migrated[0].token_ids == full[k:]
    # and on the same worker, batched with strangers, too
    batched = llm.generate([prompt + full[:k], "other text", "x" * 40], SamplingParams(max_tokens=total - k,
                                                                                          **params))
    assert batched[0].token_ids == full[k:]


def test_greedy_takes_the_first_of_tied_maxima_in_every_row():
    logits = torch.zeros(3, VOCAB)
    logits[0, [5, 9]] = 2.0
    logits[1, [VOCAB - 1, 0]] = 1.0
    logits[2, 300:] = -1.0  # the maximum (0) everywhere below 300
    assert sample(logits, [SamplingParams(temperature=0.0)] * 3, [0, 0, 0]) == [5, 0, 0]
