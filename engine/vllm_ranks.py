"""A tensor-parallel vLLM engine's KV as the worker's process sees it: a mirror of every rank's KV heads.

With tensor parallelism vLLM runs its ranks in child processes of the worker (its `mp` executor), each holding
its share of the KV heads (`engine.vllm_layout.heads_of_rank`) in its own memory. The worker's process,
where pdserve's transfers, digests and drains read KV, holds none of it. `RankMirror` is a cache of pdserve's
shape over every KV head, indexed by vLLM's block ids, its bytes in vLLM's order as with one device
(`engine.vllm_layout`), filled from the ranks on demand, between steps (vLLM's `collective_rpc`): the blocks a
prefill ships, after the step that finished its prompt; a held sequence's, for a drain; a sequence's, for a
digest. KV goes to the ranks the other way, in the step's connector metadata.

So a prefill over ranks ships its KV whole after the step, not layer by layer while the step runs, and the
wire, the staging cache and the decode side are the same whatever either pool's tensor-parallel size: a
prefill pool of two ranks feeds a decode pool of one, or of four. The mirror is allocated, not touched; its
pages cost memory only where blocks were read into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from engine.vllm_layout import heads_of_rank, heads_per_rank


class RankMirror:
    """Every KV head of a tensor-parallel vLLM engine's `num_blocks` blocks, read from its ranks on demand."""

    def __init__(self, llm: Any, num_blocks: int) -> None:
        self._llm = llm
        specs: list[KVCacheSpec] = llm.collective_rpc(rank_spec)
        self.tp_size = len(specs)
        first = specs[0]
        heads = llm.model_config.get_total_num_kv_heads()
        if any(s != first for s in specs) or first.num_kv_heads != heads_per_rank(heads, self.tp_size):
            raise NotImplementedError(f"vLLM's ranks hold KV caches {specs}, not {heads} KV heads split "
                                      f"{self.tp_size} ways as the pdserve connector expects")
        self.spec = KVCacheSpec(first.num_layers, heads, first.head_dim, first.block_size, first.dtype)
        shape = (first.num_layers, 2, num_blocks, *self.spec.block_shape)
        self.cache = KVCache.over(self.spec, torch.empty(shape, dtype=first.dtype))

    def read(self, block_ids: Sequence[int]) -> None:
        """Bring blocks `block_ids` up to date from the ranks (between steps: vLLM's ranks answer then)."""
        if not block_ids:
            return
        ids = list(block_ids)
        index = torch.tensor(ids, dtype=torch.int64)
        done: set[int] = set()
        for rank, part in enumerate(self._llm.collective_rpc(read_blocks, args=(ids,))):
            heads = heads_of_rank(self.spec.num_kv_heads, self.tp_size, rank)
            if heads.start not in done:  # (fewer heads than ranks: each head is on several)
                done.add(heads.start)
                self.cache.tensor[..., heads, :].index_copy_(2, index, part)


# -- what the engine asks every rank (vLLM's `collective_rpc`, in the rank's process; `worker` is vLLM's) ------

def rank_spec(worker: Any) -> KVCacheSpec:
    """This rank's KV cache shape (its share of the KV heads)."""
    from engine.vllm_connector import my_layout

    return my_layout().spec


def read_blocks(worker: Any, block_ids: list[int]) -> torch.Tensor:
    """This rank's KV heads of blocks `block_ids`, every layer, in vLLM's byte order (a copy)."""
    from engine.vllm_connector import my_layout

    return my_layout().blocks.tensor.index_select(2, torch.tensor(block_ids, dtype=torch.int64))
