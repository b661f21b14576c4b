"""The engine on a CUDA device, against transformers on the same device and weights. Skipped without CUDA
(`pytest -m gpu`); nothing here needs Ray or the SmolLM2 checkpoint, so it runs on a bare GPU machine.

- float32 (TF32 off on both sides): prefill and every decode step's logits within 1e-4 of transformers'.
- bfloat16 (the engine's GPU default): logits within bf16's precision of transformers' float32.
- n-gram speculation on CUDA: greedy output equals plain decoding token for token, drafts accepted.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import LLM
from engine.config import SpeculativeConfig
from engine.hub import ensure_tiny_random
from tests.engine.helpers import greedy, make_engine, rel_err, run_capturing_logits

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def no_tf32():
    """TF32 matmuls round to 10 mantissa bits: not what a float32 comparison means."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def hf_on_cuda() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(str(ensure_tiny_random()), attn_implementation="eager",
                                            dtype=torch.float32).to("cuda").eval()


def max_step_error(dtype: str) -> float:
    engine = make_engine(device="cuda", dtype=dtype)
    assert engine.device.type == "cuda"
    hf = hf_on_cuda()
    prompt = list(range(3, 40))
    req = engine.add_request(prompt, greedy(16, ignore_eos=True))
    steps = run_capturing_logits(engine)[req.request_id]
    tokens = prompt + req.output_token_ids
    errors = []
    for i, ours in enumerate(steps):
        with torch.no_grad():
            ref = hf(torch.tensor([tokens[:len(prompt) + i]], device="cuda")).logits[0, -1].float()
        errors.append(rel_err(ours.float().to("cuda"), ref))
    assert len(errors) == 16
    return max(errors)


def test_float32_logits_match_transformers_on_cuda():
    assert max_step_error("float32") <= 1e-4


def test_bfloat16_logits_are_within_bf16_precision_of_transformers_float32():
    assert max_step_error("bfloat16") <= 3e-2


def test_speculation_on_cuda_equals_plain_greedy_and_accepts_drafts():
    plain = LLM("tiny-random", device="cuda", dtype="float32", num_blocks=512, max_model_len=256)
    spec = LLM("tiny-random", device="cuda", dtype="float32", num_blocks=512, max_model_len=256,
               speculative=SpeculativeConfig("ngram"))
    prompts = [[20 + i, 30 + i, 40 + i, 50 + i] * 4 for i in range(4)] + [[(7 * j) % 250 + 3 for j in range(12)]]
    ref = plain.generate(prompts, greedy(40, ignore_eos=True))
    out = spec.generate(prompts, greedy(40, ignore_eos=True))
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0
