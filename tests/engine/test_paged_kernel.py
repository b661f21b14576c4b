"""The paged-attention kernel (`engine/kernels`) against SDPA, and the engine over it against transformers.

SDPA is the reference: for each sequence its blocks are gathered by index into a dense context, and
`F.scaled_dot_product_attention` runs in float32 with a causal-from-the-end mask. The kernel reads the
same blocks where they lie.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.attention import KERNEL_PARTITION
from engine.config import cdiv
from engine.kernels import cpu_kernels
from engine.kv_cache import as_cache_dtype
from engine.model_runner import ModelRunner
from tests.engine.helpers import greedy, make_engine, rel_err, run_capturing_logits

KERNELS = cpu_kernels()
# how far an 8-bit cache moves the tiny model's logits from a float32 cache's (relative to their largest),
# measured 2026-12-07 with a margin
BOUND_FP8 = 0.1  # measured up to 0.045
BOUND_FP8_E5M2 = 0.15  # up to 0.069
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the paged-attention kernel could not be built here")


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              seqs: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32)
    for (q_start, q_len, ctx), table in zip(seqs.tolist(), tables):
        blocks = table[:cdiv(ctx, k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1)[None].float()  # [1, kv_heads, ctx, d]
        v = v_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1)[None].float()
        qs = q[q_start:q_start + q_len].transpose(0, 1)[None].float()
        visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        out[q_start:q_start + q_len] = o[0].transpose(0, 1)
    return out


def random_batch(rng: random.Random, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 contexts: list[int], q_lens: list[int], dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    """Sequences whose blocks are scattered through a cache with spare blocks; q is a view into a wider
    tensor (as the model's q is a slice of its fused qkv). The cache is `cache_dtype` (default q's)."""
    cache_dtype = cache_dtype or dtype
    widths = [cdiv(c, block_size) for c in contexts]
    num_blocks = sum(widths) + 7
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(len(contexts), max(widths), dtype=torch.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = torch.tensor([ids.pop() for _ in range(w)])
    rows = sum(q_lens)
    q = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)[:, :heads]
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    seqs = torch.tensor(list(zip(starts, q_lens, contexts)), dtype=torch.int32)
    return q, k_cache, v_cache, tables, seqs


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # SmolLM2-135M: GQA 3
    (8, 8, 32, 16),  # MHA
    (8, 1, 128, 32),  # MQA, wide heads
    (4, 2, 16, 1),  # a token per block
    (12, 4, 64, 128),  # vLLM's CPU block size
])
@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    # a 16-bit cache under a float32 model (`CacheConfig.dtype`): widened as it is read
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    # an 8-bit float cache (`--kv-cache-dtype fp8` / fp8_e5m2); e4m3's subnormals (below 2^-6) among them,
    # e5m2's (below 6e-5) hardly: the next test reads every byte
    (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2),
])
def test_kernel_equals_sdpa_on_random_shapes(heads, kv_heads, head_dim, block_size, dtype, cache_dtype):
    rng = random.Random(hash((heads, kv_heads, head_dim, block_size, str(dtype), str(cache_dtype))) & 0xFFFF)
    # contexts at, just past and well across block and partition boundaries; decode rows and short chunks
    contexts = [1, block_size, block_size + 1, KERNEL_PARTITION, KERNEL_PARTITION + 1,
                3 * KERNEL_PARTITION - 5, rng.randrange(2, 900)]
    q_lens = [1, 1, 2, 1, 5, 8, 1]
    q, k_cache, v_cache, tables, seqs = random_batch(rng, heads, kv_heads, head_dim, block_size,
                                                     contexts, [min(n, c) for n, c in zip(q_lens, contexts)],
                                                     dtype, cache_dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    scale = head_dim ** -0.5
    KERNELS.paged_attention(out, q, k_cache, v_cache, tables, seqs, scale, KERNEL_PARTITION)
    want = reference(q, k_cache, v_cache, tables, seqs, scale)
    # bf16 output: its own rounding (8 bits of mantissa). A 16- or 8-bit cache under float32 q holds the very
    # values the reference reads, so the float32 bound holds there too.
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert not out.isnan().any(), "a row was left unwritten"
    assert (out.float() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [64, 32])  # the vectorised widening, and the scalar pass's
def test_kernel_widens_every_8_bit_float_exactly(cache_dtype, head_dim):
    """Every finite byte of an e4m3 or e5m2 cache (subnormals, zero, the largest) reads as the float32 torch
    makes of it: a sequence of one token attends only to itself, so its output is its value row. (The
    special bytes are left out: a saturating write, the next test's, never makes them.)"""
    every_byte = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    finite = [b for b in range(256) if every_byte[b].isfinite()]
    rows = cdiv(len(finite), head_dim)
    values = torch.tensor((finite * rows)[:rows * head_dim], dtype=torch.uint8).view(cache_dtype)
    v_cache = values.view(rows, 1, 1, head_dim)  # one block per sequence, block_size 1, one KV head
    k_cache = torch.ones(rows, 1, 1, head_dim).to(cache_dtype)
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    seqs = torch.tensor([(i, 1, 1) for i in range(rows)], dtype=torch.int32)
    q = torch.randn(rows, 1, head_dim)
    out = torch.full(q.shape, float("nan"))
    KERNELS.paged_attention(out, q, k_cache, v_cache, tables, seqs, head_dim ** -0.5, KERNEL_PARTITION)
    assert torch.equal(out[:, 0], v_cache[:, 0, 0].float())


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("fp8", torch.float8_e4m3fn),
                                                  ("fp8_e5m2", torch.float8_e5m2)])
def test_an_8_bit_cache_saturates_what_it_cannot_hold(kv_cache_dtype, dtype):
    """K and V past an 8-bit float's range are written as its largest value, never as infinity (torch's own
    conversion saturates e4m3 but makes e5m2's overflow infinite, which attention turns into NaN)."""
    most = torch.finfo(dtype).max
    written = as_cache_dtype(torch.tensor([1e6, -1e6, float("inf"), 3.0]), dtype)
    assert written.float().tolist() == [most, -most, most, 3.0]
    assert make_engine(kv_cache_dtype=kv_cache_dtype).kv_cache.tensor.dtype == dtype  # the flag's name


def test_kernel_refuses_mismatched_inputs_naming_them():
    q, k_cache, v_cache, tables, seqs = random_batch(random.Random(0), 4, 2, 16, 16, [20], [1], torch.float32)
    out = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match="int32"):
        KERNELS.paged_attention(out, q, k_cache, v_cache, tables.long(), seqs, 0.25, KERNEL_PARTITION)
    with pytest.raises(RuntimeError, match="one dtype"):
        KERNELS.paged_attention(out, q, k_cache.double(), v_cache, tables, seqs, 0.25, KERNEL_PARTITION)
    with pytest.raises(RuntimeError, match="bfloat16/float16/float8 under float32 q"):
        KERNELS.paged_attention(out.bfloat16(), q.bfloat16(), k_cache.half(), v_cache.half(), tables, seqs, 0.25,
                                KERNEL_PARTITION)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        KERNELS.paged_attention(out[:, :3], q[:, :3], k_cache, v_cache, tables, seqs, 0.25, KERNEL_PARTITION)


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load():
    """torch's extension builder leaves a `lock` file behind when its process dies mid-build (a chaos test's
    SIGKILL, the OOM killer), and its next load waits on that file forever: pdserve's own flock (released by
    the kernel with its holder) proves the file stale and removes it. A fresh process loads the cached kernel
    with the stale file there."""
    from engine import kernels

    build = kernels.cache_dir() / kernels._name()
    (build / "lock").write_text("")  # what a builder killed mid-build leaves
    code = "from engine.kernels import cpu_kernels; assert cpu_kernels() is not None"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PDSERVE_KERNELS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left by a kernel build that did not finish" in done.stderr
    assert not (build / "lock").exists()


def test_a_built_kernel_loads_without_the_builder_and_a_broken_one_is_built_again(tmp_path):
    """A fresh process loads the module its build directory holds without torch's builder (which ran ninja
    again, and rebuilt whenever another ninja was first on PATH): here the builder cannot even be imported.
    A module that does not load (a build cut short) is not taken: the builder runs."""
    from engine import kernels

    code = ("import sys; sys.modules['torch.utils.cpp_extension'] = None\n"
            "from engine.kernels import cpu_kernels, gguf_kernels\n"
            "assert cpu_kernels() is not None and gguf_kernels() is not None")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    broken = tmp_path / "pdserve_kernels_x"
    broken.mkdir()
    (broken / "pdserve_kernels_x.so").write_bytes(b"not an ELF file")
    assert kernels._import_built("pdserve_kernels_x", broken) is None
    assert kernels._import_built("pdserve_kernels_y", broken) is None  # none there


def test_engine_decodes_through_the_kernel_and_matches_the_gathering_path():
    """The same requests, one engine with the kernel and one with it off: the kernel is used (a decode
    step's metadata carries it) and the logits agree with the grouped gather + SDPA path."""
    prompts = [[(5 * i + j) % 250 + 3 for i in range(n)] for j, n in enumerate((7, 40, 300, 33))]
    fast, plain = make_engine(max_num_batched_tokens=512), make_engine(max_num_batched_tokens=512)
    plain.runner.kernels = None
    seen: list[bool] = []
    prepare = fast.runner.prepare

    def spy(chunks):
        inputs = prepare(chunks)
        seen.append(inputs.meta.kernel is not None)
        return inputs

    fast.runner.prepare = spy  # type: ignore[method-assign]
    for engine in (fast, plain):
        for p in prompts:
            engine.add_request(p, greedy(10, ignore_eos=True))
    ours, theirs = run_capturing_logits(fast), run_capturing_logits(plain)
    assert any(seen) and isinstance(fast.runner, ModelRunner)
    for rid in ours:
        for a, b in zip(ours[rid], theirs[rid], strict=True):
            assert rel_err(a, b) <= 1e-5


@pytest.fixture(scope="module")
def smollm2(smollm2_hf):
    from engine import LLM

    hf = smollm2_hf
    return LLM("smollm2-135m", num_blocks=400, dtype="float32", device="cpu",
               max_num_batched_tokens=2048).engine, hf


def _decode_against_hf(engine, hf, contexts: list[int], steps: int) -> None:
    """Prompts of the given lengths decoded together (the kernel's batch); every step's logits against
    transformers run alone on each sequence with its own KV cache."""
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in contexts]
    reqs = [engine.add_request(p, greedy(steps, ignore_eos=True)) for p in prompts]
    got = run_capturing_logits(engine)
    for prompt, req in zip(prompts, reqs):
        tokens = prompt + req.output_token_ids
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), use_cache=True)
            ref = [out.logits[0, -1].float()]
            past = out.past_key_values
            for t in tokens[len(prompt):len(prompt) + steps - 1]:
                out = hf(torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                ref.append(out.logits[0, -1].float())
        for i, (a, b) in enumerate(zip(got[req.request_id], ref, strict=True)):
            assert rel_err(a, b) <= 1e-4, f"context {len(prompt)}, step {i}: relative error {rel_err(a, b):.2e}"


@pytest.mark.slow
def test_smollm2_logits_match_hf_decoding_at_16_256_and_1024_tokens_of_context(smollm2):
    _decode_against_hf(*smollm2, [16, 256, 1024], steps=4)


@pytest.mark.slow
@pytest.mark.soak
def test_smollm2_logits_match_hf_decoding_at_4096_tokens_of_context(smollm2):
    _decode_against_hf(*smollm2, [4096, 300], steps=3)


@pytest.mark.parametrize("kv_cache_dtype,dtype,shrink,bound", [
    ("bfloat16", torch.bfloat16, 2, 2e-2),  # 8 significant bits
    ("fp8", torch.float8_e4m3fn, 4, BOUND_FP8),  # 4 (vLLM's name for e4m3)
    ("fp8_e5m2", torch.float8_e5m2, 4, BOUND_FP8_E5M2),  # 3, a wider range
])
def test_a_narrow_cache_under_float32_weights_shrinks_the_cache_and_both_paths_read_it_alike(
        kv_cache_dtype, dtype, shrink, bound):
    """`CacheConfig.dtype`: K and V are rounded into a bfloat16 or 8-bit float cache, the model stays
    float32. The cache's bytes halve or quarter; the kernel and the gathering path read the same rounded
    values (logits within 1e-5 of each other); against the float32 cache the logits move by the rounding
    only."""
    prompts = [[(7 * i + j) % 250 + 3 for i in range(n)] for j, n in enumerate((5, 70, 290))]
    narrow, plain = make_engine(kv_cache_dtype=kv_cache_dtype), make_engine(kv_cache_dtype=kv_cache_dtype)
    full = make_engine()
    plain.runner.kernels = None
    assert narrow.kv_cache.tensor.dtype == dtype and narrow.model.dtype == torch.float32
    assert narrow.cache_spec.bytes_per_block * shrink == full.cache_spec.bytes_per_block
    for engine in (narrow, plain, full):
        for p in prompts:
            engine.add_request(p, greedy(6, ignore_eos=True))
    a, b, c = (run_capturing_logits(e) for e in (narrow, plain, full))
    for rid in a:
        for x, y, z in zip(a[rid], b[rid], c[rid], strict=True):
            assert rel_err(x, y) <= 1e-5
            # from the first token on, a whole prompt in one step included: it too attends over its K and V
            # as the cache holds them (see the next test)
            assert 0 < rel_err(x, z) <= bound, f"{kv_cache_dtype}: rounding K and V, and only that"
            if x.argmax() != z.argmax():  # the two sequences differ from here on: nothing left to compare
                break


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8", "fp8_e5m2"])
def test_a_narrow_cache_gives_the_same_logits_however_the_prompt_was_chunked_or_recomputed(kv_cache_dtype):
    """What a step computes over a narrow cache does not depend on how the prompt reached it: in one chunk
    (attending over its own new K and V), in 16-token chunks (attending over the cache), or recomputed with
    its first generated tokens as one longer prompt, as a migration by recompute does. So a stream moved
    after a worker's death goes on with the tokens it would have had, whatever the cache's dtype."""
    prompt = [(11 * i) % 250 + 3 for i in range(70)]
    whole, chunked = make_engine(kv_cache_dtype=kv_cache_dtype), make_engine(
        kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16)
    for engine in (whole, chunked):
        engine.add_request(prompt, greedy(6, ignore_eos=True))
    a, b = (next(iter(run_capturing_logits(e).values())) for e in (whole, chunked))
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert rel_err(x, y) <= 1e-5, f"step {step}: chunking changed the logits"
    generated = [int(x.argmax()) for x in a]
    for k in (1, 4):  # the stream's first k tokens, recomputed as part of the prompt
        again = make_engine(kv_cache_dtype=kv_cache_dtype)
        again.add_request(prompt + generated[:k], greedy(1, ignore_eos=True))
        (x,) = next(iter(run_capturing_logits(again).values()))
        assert rel_err(x, a[k]) <= 1e-5, f"recomputing {k} tokens changed the next one's logits"


def test_an_8_bit_cache_under_a_bfloat16_model_gathers_for_sdpa():
    """The kernel widens narrow caches under float32 queries only; a bfloat16 model over an fp8 cache
    decodes through the gathering path instead, and its logits stay those of its bfloat16 cache, within the
    8-bit rounding."""
    prompts = [[(5 * i + j) % 250 + 3 for i in range(n)] for j, n in enumerate((9, 140))]
    fp8, wide = make_engine(dtype="bfloat16", kv_cache_dtype="fp8"), make_engine(dtype="bfloat16")
    assert fp8.runner.kernels is None and fp8.kv_cache.tensor.dtype == torch.float8_e4m3fn
    for engine in (fp8, wide):
        for p in prompts:
            engine.add_request(p, greedy(4, ignore_eos=True))
    a, b = run_capturing_logits(fp8), run_capturing_logits(wide)
    for rid in a:
        for x, y in zip(a[rid], b[rid], strict=True):
            assert 0 < rel_err(x.float(), y.float()) <= BOUND_FP8
            if x.argmax() != y.argmax():  # the two sequences differ from here on
                break


# (bfloat16 in the soak run: the default suite keeps fp8, the narrower; the kernel widens both, each tested
# against SDPA above)
@pytest.mark.parametrize("kv_cache_dtype", [pytest.param("bfloat16", marks=pytest.mark.soak), "fp8"])
def test_smollm2_with_a_narrow_cache_keeps_transformers_greedy_tokens(smollm2_hf, kv_cache_dtype):
    """The real model, float32 weights over a bfloat16 or fp8 (e4m3) KV cache: the greedy tokens of
    transformers (float32 throughout) on prompts of 30-700 tokens, 12 tokens each. (No such test for
    fp8_e5m2, one mantissa bit fewer: measured, it left transformers' greedy path at the 4th token of a
    48-token prompt, where e4m3 kept 24; see docs/engine.md.)"""
    from engine import LLM

    llm = LLM("smollm2-135m", num_blocks=200, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype,
              max_num_batched_tokens=1024)
    words = ["the", "river", "carries", "old", "stones", "down", "from", "the", "hills", "and", "the", "town", "counts", "them", "every", "spring"]
    prompts = [" ".join(words[(i * 3) % len(words):] + words * n) for i, n in enumerate((2, 12, 45))]
    outs = llm.generate(prompts, greedy(12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            want = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                       min_new_tokens=12)[0, len(ids):].tolist()
        assert out.token_ids == want, f"prompt of {len(ids)} tokens"
