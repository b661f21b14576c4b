"""SmolLM2 greedy over narrow caches against transformers float32: how many of 24 tokens agree.

    python benchmarks/results/narrow-cache-greedy-2026-12-07/greedy24.py  # output: greedy24.txt
"""
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from engine.hub import smollm2_gguf_path
from engine.sampling_params import SamplingParams

gguf = smollm2_gguf_path()
hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                          attn_implementation="eager").eval()
words = ["the", "river", "carries", "old", "stones", "down", "from", "the", "hills", "and", "the", "town",
         "counts", "them", "every", "spring"]
prompts = [" ".join(words[(i * 3) % len(words):] + words * n) for i, n in enumerate((2, 12, 45))]
prompts += ["def fibonacci(n):\n    ", "Once upon a time"]
want = {}
for dtype in ("bfloat16", "fp8", "fp8_e5m2"):
    llm = LLM("smollm2-135m", num_blocks=200, dtype="float32", device="cpu", kv_cache_dtype=dtype,
              max_num_batched_tokens=1024)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = llm.tokenizer.encode(p)
        if p not in want:
            with torch.no_grad():
                want[p] = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                      min_new_tokens=24)[0, len(ids):].tolist()
        got = o.token_ids
        agree = next((i for i, (a, b) in enumerate(zip(got, want[p])) if a != b), 24)
        print(f"{dtype:9s} prompt {len(ids):4d} tokens: {agree}/24 greedy tokens equal transformers'",
              flush=True)
