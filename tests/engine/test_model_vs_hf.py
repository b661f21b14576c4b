"""The engine against an independent reference: transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import LLM
from engine.checkpoint import byte_tokenizer, random_state_dict, write_checkpoint
from engine.hub import TINY_RANDOM_CONFIG
from tests.engine.helpers import greedy, make_engine, rel_err, run_capturing_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
]


def hf_next_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def assert_logits_match(engine, hf, prompt_ids: list[int], max_tokens: int, tol: float = 1e-4) -> None:
    req = engine.add_request(prompt_ids, greedy(max_tokens, ignore_eos=True))
    steps = run_capturing_logits(engine)[req.request_id]
    assert len(steps) == max_tokens
    tokens = prompt_ids + req.output_token_ids
    for i, ours in enumerate(steps):  # step 0 is the prefill, then one decode step per token
        ref = hf_next_logits(hf, tokens[:len(prompt_ids) + i])
        assert rel_err(ours, ref) <= tol, f"step {i}: relative error {rel_err(ours, ref):.2e}"


@pytest.fixture(scope="module")
def smollm2_llm():
    return LLM("smollm2-135m", num_blocks=128, dtype="float32", device="cpu")


def test_tiny_random_logits_match_hf_prefill_and_every_decode_step():
    engine = make_engine()
    from engine.hub import ensure_tiny_random

    hf = LlamaForCausalLM.from_pretrained(str(ensure_tiny_random()), attn_implementation="eager").eval()
    assert_logits_match(engine, hf, list(range(3, 40)), max_tokens=24)


@pytest.mark.parametrize("variant", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, "rope_theta": 500000.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"num_kv_heads": 4, "tie_word_embeddings": True},  # plain MHA, tied embeddings (TinyLlama/SmolLM2 shape)
    {"num_kv_heads": 1, "head_dim": 32},  # MQA and head_dim != hidden / heads
], ids=["llama3-rope", "linear-rope", "mha-tied", "mqa-wide-head"])
def test_llama_family_variants_match_hf(tmp_path, variant):
    config = dataclasses.replace(TINY_RANDOM_CONFIG, **variant)
    write_checkpoint(tmp_path, config, random_state_dict(config, seed=1), byte_tokenizer(""))
    engine = make_engine(str(tmp_path))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    # a prompt longer than original_max_position_embeddings so the llama3 long-wavelength branch matters
    assert_logits_match(engine, hf, [(7 * i) % 250 for i in range(90)], max_tokens=8)


@pytest.mark.slow
def test_smollm2_logits_match_hf_prefill_and_every_decode_step(smollm2_llm, smollm2_hf):
    ids = smollm2_llm.tokenizer.encode(PROMPTS[2])
    assert_logits_match(smollm2_llm.engine, smollm2_hf, ids, max_tokens=12)


@pytest.mark.slow
def test_smollm2_greedy_32_tokens_equal_hf_generate(smollm2_llm, smollm2_hf):
    outs = smollm2_llm.generate(PROMPTS, greedy(32))
    for prompt, out in zip(PROMPTS, outs):
        ids = smollm2_llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
        assert out.token_ids == ref.tolist(), prompt
        assert out.text == smollm2_llm.tokenizer.decode(ref.tolist())
