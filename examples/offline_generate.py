"""Offline generation with pdserve's engine, the way vLLM users write it."""

from engine import LLM, SamplingParams

prompts = [
    "The capital of France is",
    "Write a haiku about the sea:",
    [1, 504, 3458, 282],  # prompts may also be token ids
]
llm = LLM(model="smollm2-135m")
for out in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0), use_tqdm=True):
    print(f"{out.prompt_token_ids[:8]}... -> {out.text!r} ({out.finish_reason.value})")
