"""Batch-1 decode step variants timed against the engine's own, steps interleaved in one process.

Each variant is a forward over the engine's weights that differs from `LlamaForCausalLM.forward` in one
place: RMSNorm's sum of squares as one `vector_norm`; a lone decode row's attention as bmm, softmax, bmm
instead of SDPA; gate and up as one matmul followed by `silu(g) * u` (instead of two matmuls with oneDNN
post-ops). A request's decode steps take turns among the variants, so all see the same machine load; each
request's greedy tokens are checked against a run of the engine's own forward. Prints each variant's median
step and its ratio to the engine's, and the roofline fraction. `same` is the engine's forward re-stated
here: its ratio to `base` is the probe's own noise.

    python -m benchmarks.decode_variants_probe [--threads 2] [--requests 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.engine_bench import MODEL, copy_bandwidth, decode_bytes, greedy, random_prompt
from engine.attention import _gather_kv, paged_attention
from engine.config import CacheConfig, EngineConfig
from engine.hub import resolve_model
from engine.llm_engine import LLMEngine
from engine.loader import load_checkpoint
from engine.models.llama import Matmul, unit_rms


def norm_by_vector_norm(h: torch.Tensor, eps: float) -> torch.Tensor:
    return h * torch.linalg.vector_norm(h, dim=-1, keepdim=True).square_().add_(eps).rsqrt_()


def attention_by_bmm(q, k, v, k_cache, v_cache, meta, scale):
    """A lone decode row by bmm/softmax/bmm; anything else as the engine does."""
    s = meta.seqs[0] if len(meta.seqs) == 1 and not meta.decode_groups else None
    if s is None or s.q_len != 1 or s.fresh:
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
    ks, vs = _gather_kv(k_cache, v_cache, s.block_table, meta.workspace)
    ks, vs = ks.view(-1, kvh, d)[:s.ctx_len], vs.view(-1, kvh, d)[:s.ctx_len]
    scores = torch.bmm(q.view(kvh, -1, d), ks.permute(1, 2, 0)).mul_(scale)  # [kvh, group, L]
    return torch.bmm(scores.softmax(-1), vs.transpose(0, 1)).view(1, -1, d)


def fused_gate_up(engine: LLMEngine) -> list[Matmul]:
    """Each layer's gate and up stacked in one matrix, the MLP norm folded in as the engine folds it."""
    c = engine.model.config
    _, state = load_checkpoint(resolve_model(engine.config.model))
    out = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w = torch.cat([state[p + "mlp.gate_proj.weight"].float(), state[p + "mlp.up_proj.weight"].float()])
        w = w * (state[p + "post_attention_layernorm.weight"].float() * c.hidden_size ** 0.5)
        out.append(Matmul(w.contiguous()))
    return out


def make_forward(engine: LLMEngine, norm=unit_rms, attention=paged_attention, gate_up: list[Matmul] | None = None):
    m, c = engine.model, engine.model.config

    @torch.inference_mode()
    def forward(input_ids, positions, meta, kv_cache, logits_indices, layer_hook=None):
        eps = c.rms_norm_eps * c.hidden_size
        h = F.embedding(input_ids, m.embed)
        T = h.shape[0]
        cos, sin = m.rope.lookup(positions)
        for i, layer in enumerate(m.layers):
            qkv = layer.qkv(norm(h, eps))
            qk = m.rope.rotate(qkv[:, :c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim),
                               cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, c.q_size + c.kv_size:].view(T, c.num_kv_heads, c.head_dim)
            a = attention(q, k, v, *kv_cache.layer(i), meta, m.scale)
            if layer_hook is not None:
                layer_hook(i)
            h = layer.o.add(a.reshape(T, c.q_size), h)
            x = norm(h, eps)
            if gate_up is None:
                h = layer.down.add(layer.up.mul(x, layer.gate.silu(x)), h)
            else:
                g, u = gate_up[i](x).chunk(2, dim=-1)
                h = layer.down.add(F.silu(g).mul_(u), h)
        return m.lm_head(norm(h[logits_indices], eps)).float()

    return forward


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8, help="requests of 60 tokens, one after another")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu", dtype="float32", num_threads=args.threads,
                                    cache=CacheConfig(block_size=16, num_blocks=256),
                                    quantization="none"))  # (its variants rewrite the float32 matrices)
    gate_up = fused_gate_up(engine)
    variants = {"base": engine.model.forward, "same": make_forward(engine),
                "vector_norm": make_forward(engine, norm=norm_by_vector_norm),
                "bmm_attention": make_forward(engine, attention=attention_by_bmm),
                "gate_up": make_forward(engine, gate_up=gate_up),
                "all": make_forward(engine, norm_by_vector_norm, attention_by_bmm, gate_up)}
    names, times = list(variants), {k: [] for k in variants}
    vocab = engine.model.config.vocab_size
    for n in range(args.requests):
        prompt = random_prompt(random.Random(n), 64, vocab)
        engine.model.forward = variants["base"]
        want = engine.add_request(prompt, greedy(60))
        while engine.has_unfinished_requests():
            engine.step()
        got = engine.add_request(prompt, greedy(60))
        engine.step()  # its prefill, with the engine's forward
        k = n
        while engine.has_unfinished_requests():
            name = names[k % len(names)]
            k += 1
            engine.model.forward = variants[name]
            t0 = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t0)
        assert got.output_token_ids == want.output_token_ids, "a variant changed the greedy tokens"
        engine.allocator.reset_cache()
        print(f"request {n + 1}/{args.requests} done", flush=True)
    bandwidth = copy_bandwidth()
    roofline = decode_bytes(engine.model) / bandwidth
    base = statistics.median(times["base"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:14s} {med * 1e3:6.2f} ms/step  {base / med:.3f}x the engine's  {roofline / med:.2f} of the "
              f"roofline ({bandwidth / 1e9:.1f} GB/s copy)  {len(t)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
