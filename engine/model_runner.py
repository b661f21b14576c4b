"""Turns a SchedulerOutput into model inputs, runs the model, and returns one logits row per sequence."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.attention import (
    DECODE_GROUP_SLACK,
    KERNEL_MAX_QUERY,
    AttentionMetadata,
    DecodeGroup,
    KernelBatch,
    SeqAttention,
)
from engine.config import cdiv
from engine.kernels import cpu_kernels
from engine.kv_cache import KVCache
from engine.models.llama import LayerHook, LlamaForCausalLM
from engine.scheduler import ScheduledChunk, SchedulerOutput


class ModelInputs(NamedTuple):
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # [sum of chunk.num_logits] the rows whose logits are wanted: each chunk's last token, or for a chunk
    # with drafts its last token and every draft
    logits_indices: torch.Tensor


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = kv_cache.device
        # attention's gather scratch; grows to the largest step seen and is kept (see `_gather_kv`)
        self.workspace = torch.empty(0, dtype=kv_cache.spec.dtype, device=self.device)
        # the paged kernel reads the cache in place; on other devices, or unbuilt, decode rows gather
        # (under a float32 model, or over a cache of the model's dtype: it widens narrow caches as it reads)
        narrow = kv_cache.spec.dtype != model.dtype and model.dtype != torch.float32
        self.kernels = cpu_kernels() if self.device.type == "cpu" and not narrow else None

    def execute(self, out: SchedulerOutput, layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Logits [sum of chunk.num_logits, vocab] (float32), chunk by chunk: at each chunk's last token, and
        at each draft of a chunk that carries drafts (see `ModelInputs.logits_indices`)."""
        inputs = self.prepare(out.chunks)
        return self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache,
                                  inputs.logits_indices, layer_hook)

    def prepare(self, chunks: list[ScheduledChunk]) -> ModelInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        seqs: list[SeqAttention] = []
        decode_rows: list[tuple[int, ScheduledChunk]] = []
        kernel_rows: list[tuple[int, ScheduledChunk]] = []
        for c in chunks:
            req, q_start = c.request, len(ids)
            ids += [req.token_at(p) for p in range(c.start, c.end - len(c.draft_token_ids))]
            ids += c.draft_token_ids
            pos = range(c.start, c.end)
            positions += pos
            slots += [req.block_ids[p // bs] * bs + p % bs for p in pos]
            logits_indices += range(len(ids) - c.num_logits, len(ids))
            if self.kernels is not None and c.start > 0 and c.num_tokens <= KERNEL_MAX_QUERY:
                kernel_rows.append((q_start, c))
            elif c.num_tokens == 1 and c.start > 0:
                decode_rows.append((q_start, c))
            else:
                seqs.append(self._seq_attention(q_start, c))
        if len(decode_rows) == 1:
            q_start, c = decode_rows.pop()
            seqs.append(self._seq_attention(q_start, c))
        dev = self.device
        groups = self._decode_groups(decode_rows)
        gathered = [len(s.block_table) for s in seqs if s.block_table is not None]
        gathered += [len(g.block_ids) for g in groups]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            seqs=seqs,
            decode_groups=groups,
            kernel=self._kernel_batch(kernel_rows),
            num_tokens=len(ids),
            workspace=self._workspace(max(gathered, default=0)),
        )
        return ModelInputs(torch.tensor(ids, dtype=torch.long, device=dev),
                           torch.tensor(positions, dtype=torch.long, device=dev), meta,
                           torch.tensor(logits_indices, dtype=torch.long, device=dev))

    def _workspace(self, num_blocks: int) -> torch.Tensor:
        """Room for the K and V of `num_blocks` blocks of one layer."""
        spec = self.kv_cache.spec
        need = 2 * num_blocks * spec.block_size * spec.num_kv_heads * spec.head_dim
        if self.workspace.numel() < need:
            self.workspace = torch.empty(need, dtype=spec.dtype, device=self.device)
        return self.workspace

    def _seq_attention(self, q_start: int, c: ScheduledChunk) -> SeqAttention:
        if c.start == 0:
            return SeqAttention(q_start, c.num_tokens, fresh=True)
        ctx = c.end
        table = torch.tensor(c.request.block_ids[:cdiv(ctx, self.block_size)], dtype=torch.long,
                             device=self.device)
        mask = None
        if c.num_tokens > 1:  # a later prefill chunk: causal within the chunk, full view of the past
            q_pos = torch.arange(c.start, c.end, device=self.device)
            mask = self._additive_mask(torch.arange(ctx, device=self.device)[None, :] > q_pos[:, None])
        return SeqAttention(q_start, c.num_tokens, fresh=False, block_table=table, ctx_len=ctx, mask=mask)

    def _kernel_batch(self, rows: list[tuple[int, ScheduledChunk]]) -> KernelBatch | None:
        if not rows or self.kernels is None:
            return None
        tables = _padded_tables(rows, max(cdiv(c.end, self.block_size) for _, c in rows))
        return KernelBatch(self.kernels, torch.tensor(tables, dtype=torch.int32),
                           torch.tensor([(q, c.num_tokens, c.end) for q, c in rows], dtype=torch.int32))

    def _decode_groups(self, rows: list[tuple[int, ScheduledChunk]]) -> list[DecodeGroup]:
        rows = sorted(rows, key=lambda r: r[1].end)
        groups: list[DecodeGroup] = []
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i][1].end > DECODE_GROUP_SLACK * rows[start][1].end:
                groups.append(self._decode_group(rows[start:i]))
                start = i
        return groups

    def _decode_group(self, rows: list[tuple[int, ScheduledChunk]]) -> DecodeGroup:
        bs = self.block_size
        ctx = [c.end for _, c in rows]
        width = cdiv(max(ctx), bs)
        tables = _padded_tables(rows, width)
        dev = self.device
        lens = torch.tensor(ctx, device=dev)
        padding = torch.arange(width * bs, device=dev)[None, :] >= lens[:, None]  # [B, L]
        return DecodeGroup(rows=torch.tensor([q for q, _ in rows], dtype=torch.long, device=dev),
                           block_ids=torch.tensor(tables, dtype=torch.long, device=dev).flatten(),
                           mask=self._additive_mask(padding)[:, None, None, :])

    def _additive_mask(self, hidden: torch.Tensor) -> torch.Tensor:
        """0 where attention may look, -inf where `hidden`, in the model dtype."""
        mask = torch.zeros(hidden.shape, dtype=self.model.dtype, device=self.device)
        return mask.masked_fill_(hidden, float("-inf"))


def _padded_tables(rows: list[tuple[int, ScheduledChunk]], width: int) -> list[list[int]]:
    """Each row's first `width` block ids, padded with block 0 past its own (never read: past its context)."""
    return [c.request.block_ids[:width] + [0] * (width - len(c.request.block_ids[:width])) for _, c in rows]
