"""Attention over block tables for a batch that mixes prefill chunks and decode rows.

The batch is *flattened*: every scheduled token of every sequence is one row of q/k/v ([num_tokens, heads,
head_dim]); nothing is padded to the longest sequence. Three kinds of work come out of one step:

- Decode rows, and short chunks over a cached context (a decode row with its speculative drafts), run in
  one call of the paged kernel (`engine.kernels`, on the CPU): it reads every sequence's blocks where they
  lie in the cache, with no copy, no padding and no mask (see `KernelBatch`).
- A prefill chunk attends on its own: its keys are its new rows when it starts at position 0, otherwise its
  blocks gathered from the cache (a chunk of many rows is compute-bound, and SDPA's tiled matmuls beat a
  row-at-a-time kernel 3-4x there: 1.6 vs 4.2 ms for 64 rows over 1,024 tokens, 2 threads).
- Without the kernel (another device, no compiler), decode rows run together grouped by context length so
  each group pads only to its own longest row (at most `DECODE_GROUP_SLACK` x the shortest): one gather and
  one SDPA call per group.

Masks are additive (0 to attend, -inf not to), in the model dtype, and built once per step.
NOTE: SDPA turns a bool mask into an additive one on every call, i.e. once per layer; for a 2,048-token
chunk over a 4,096-token context that is 32 MB written per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.kv_cache import as_cache_dtype, index_copy

# a decode group's longest context may be at most this many times its shortest (bounded padding)
DECODE_GROUP_SLACK = 1.25
# chunks over a cached context of at most this many rows go to the paged kernel (a decode row and its
# drafts); longer ones are prefill chunks, for SDPA. At 16 rows over 1,024 tokens SDPA is ahead already.
KERNEL_MAX_QUERY = 8
# the paged kernel splits contexts into partitions of this many tokens, merged after (so a batch of one
# still spreads over every thread)
KERNEL_PARTITION = 256


@dataclass
class KernelBatch:
    """The sequences the paged kernel attends, all in one call."""

    kernels: ModuleType  # `engine.kernels.cpu_kernels()`
    block_tables: torch.Tensor  # [S, W] int32, each sequence's blocks (padded past its own)
    seqs: torch.Tensor  # [S, 3] int32: first row in the batch, rows, context length (the new rows included)


@dataclass
class SeqAttention:
    """One sequence attended alone."""

    q_start: int
    q_len: int
    fresh: bool  # starts at position 0: attend causally over its own new k/v, no cache read
    block_table: torch.Tensor | None = None  # [num_blocks_needed] when not fresh
    ctx_len: int = 0
    mask: torch.Tensor | None = None  # [q_len, ctx_len] additive (see below); None when q_len == 1


@dataclass
class DecodeGroup:
    """Decode rows of similar context length attended in one call."""

    rows: torch.Tensor  # [B] positions of the rows in the flattened batch
    block_ids: torch.Tensor  # [B * max_blocks] the rows' block tables, flattened, padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] additive: -inf past each row's context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block * block_size + offset) of each new row
    seqs: list[SeqAttention]
    decode_groups: list[DecodeGroup]
    kernel: KernelBatch | None
    num_tokens: int
    # flat scratch with room for the K and V of the most blocks one attention call gathers this step;
    # reused by every call of every layer (see `_gather_kv`)
    workspace: torch.Tensor


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d]; k_cache, v_cache: [num_blocks, block_size, kv_heads, d].
    Writes the new k/v into their slots, then returns the attention output [T, heads, d]."""
    kvh, d = k.shape[1], k.shape[2]
    # NOTE: a cache narrower than the model (`CacheConfig.dtype`) takes k/v rounded to its dtype; what is
    # read back is widened again to q's before SDPA (the kernel widens as it reads)
    k_held, v_held = as_cache_dtype(k, k_cache.dtype), as_cache_dtype(v, v_cache.dtype)
    index_copy(k_cache.view(-1, kvh, d), 0, meta.slot_mapping, k_held)
    index_copy(v_cache.view(-1, kvh, d), 0, meta.slot_mapping, v_held)
    if k_held.dtype != k.dtype and any(s.fresh for s in meta.seqs):
        # a chunk from position 0 attends over its new k/v as the cache holds them, as every later read
        # does: otherwise a prompt's logits would depend on how it was chunked, and a stream recomputed
        # after a migration would leave the tokens it had (widening a chunk's k/v costs little)
        k, v = k_held.to(k.dtype), v_held.to(v.dtype)

    if len(meta.seqs) == 1 and not meta.decode_groups and meta.kernel is None:
        return _attend_seq(q, k, v, k_cache, v_cache, meta.seqs[0], meta.workspace, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.kernel is not None:
        b = meta.kernel
        b.kernels.paged_attention(out, q, k_cache, v_cache, b.block_tables, b.seqs, scale, KERNEL_PARTITION)
    for s in meta.seqs:
        o = _attend_seq(q, k, v, k_cache, v_cache, s, meta.workspace, scale)
        out[s.q_start:s.q_start + s.q_len] = o
    for g in meta.decode_groups:
        B = g.rows.shape[0]
        qg = q[g.rows].unsqueeze(2)  # [B, heads, 1, d]
        kg, vg = _gather_kv(k_cache, v_cache, g.block_ids, meta.workspace)
        kg = kg.view(B, -1, kvh, d).transpose(1, 2).to(q.dtype)  # [B, kv_heads, L, d]
        vg = vg.view(B, -1, kvh, d).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
        out[g.rows] = o.squeeze(2)
    return out


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
               workspace: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks, copied out of the cache in order: each [len(block_ids), block_size, kvh, d].

    NOTE: into `workspace`, not fresh tensors: tens of MB allocated per call are a fresh mmap each time,
    and faulting those pages in costs 6x the copy. Measured for a batch-64 group with contexts up to 700
    (69 MB of K and V), 2 threads: 3 ms into the workspace, 19 ms into fresh memory, 22 ms as
    `cache[block_ids]` (advanced indexing also computes an offset per element, not one per block)."""
    shape = (block_ids.shape[0], *k_cache.shape[1:])
    k_out, v_out = workspace[:2 * math.prod(shape)].view(2, *shape).unbind(0)
    return (torch.index_select(k_cache, 0, block_ids, out=k_out),
            torch.index_select(v_cache, 0, block_ids, out=v_out))


def _attend_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, s: SeqAttention, workspace: torch.Tensor,
                scale: float) -> torch.Tensor:
    end = s.q_start + s.q_len
    qs = q[s.q_start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
    if s.fresh:
        ks = k[s.q_start:end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q_len, d]
        vs = v[s.q_start:end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=s.q_len > 1, scale=scale, enable_gqa=True)
    else:
        assert s.block_table is not None, "a sequence over cached context needs its block table"
        ks, vs = _gather_kv(k_cache, v_cache, s.block_table, workspace)
        ks = ks.flatten(0, 1)[:s.ctx_len].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, kv_heads, ctx_len, d]
        vs = vs.flatten(0, 1)[:s.ctx_len].transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)  # [q_len, heads, d]
