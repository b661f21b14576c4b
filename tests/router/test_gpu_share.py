"""Workers sharing one GPU (`--prefill-resources '{"GPU": 0.5}'`): each sizes its KV cache from its share of the
device, not from whatever memory the workers started before it left free."""

from __future__ import annotations

from control.cli import build_parser, serve_config
from engine.llm_engine import kv_cache_bytes
from protocol import PoolKind

GIB = 2**30


def worker_shares(*argv: str) -> dict[PoolKind, float]:
    config = serve_config(build_parser().parse_args(["serve", *argv]))
    return {s.kind: s.worker_engine.cache.device_share for s in config.pool_specs()}


def test_a_fractional_gpu_is_the_share_each_worker_sizes_its_cache_from():
    shares = worker_shares("--prefill-resources", '{"CPU": 1, "GPU": 0.25}', "--decode-resources", '{"GPU": 0.75}')
    assert shares == {PoolKind.PREFILL: 0.25, PoolKind.DECODE: 0.75}
    # whole GPUs, several GPUs, or none: the whole device
    assert set(worker_shares("--decode-resources", '{"GPU": 2}').values()) == {1.0}
    assert set(worker_shares().values()) == {1.0}


def test_two_halves_of_one_gpu_get_equal_caches_whichever_starts_first():
    total, fraction = 140 * GIB, 0.85
    first = kv_cache_bytes(free=total, total=total, fraction=fraction, device_share=0.5)
    second = kv_cache_bytes(free=total - first - 1 * GIB, total=total, fraction=fraction, device_share=0.5)
    assert first == second == int(70 * GIB * fraction)
    # the whole device: the share changes nothing, and free memory still bounds it
    assert kv_cache_bytes(free=10 * GIB, total=total, fraction=fraction) == int(10 * GIB * fraction)
