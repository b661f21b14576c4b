"""A model family beyond Llama through the disaggregated pools: a tiny random Qwen3 checkpoint (q and k normed
per head, biases on q/k/v and o, heads wider than hidden / heads) served 1P+1D by the built-in engine, its
KV moved between the pools, greedy tokens equal to transformers' `Qwen3ForCausalLM` on the same weights."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.hub import TINY_RANDOM_CONFIG
from tests.engine.helpers import hf_of_random_checkpoint
from tests.serving.conftest import greedy_request, running_server, token_ids

pytestmark = pytest.mark.slow
PROMPTS = [[(7 * i + k) % 250 for i in range(n)] for k, n in ((1, 12), (2, 70), (3, 150))]
MAX_TOKENS = 16


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_a_qwen3_model_served_1p1d_matches_transformers_token_for_token(ray_cluster, tmp_path):
    config = dataclasses.replace(TINY_RANDOM_CONFIG, qk_norm=True, qkv_bias=True, o_bias=True, head_dim=32)
    hf = hf_of_random_checkpoint(tmp_path, config, seed=5)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    with running_server(model=str(tmp_path), num_blocks=64, prefill_workers=1, decode_workers=1) as server:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(
                lambda p: server.generate(greedy_request(p, MAX_TOKENS, ignore_eos=True)), PROMPTS))
        for prompt, expected, responses in zip(PROMPTS, want, results):
            assert token_ids(responses) == expected, len(prompt)
            # its KV went from the prefill pool to the decode pool
            assert responses[-1].timing.placement == "remote"
        reports = server.wait_idle()
        assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values()), reports
