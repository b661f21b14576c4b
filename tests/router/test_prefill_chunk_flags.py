"""`--prefill-chunk-tokens`, `--decode-prefill-chunk-tokens` and `--lower-class-chunk-tokens`: which pools get which prompt cap per step."""

from __future__ import annotations

import pytest

from control.cli import build_parser, serve_config
from protocol import PoolKind


def config(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def caps(*argv: str) -> dict[PoolKind, int]:
    return {s.kind: s.engine.scheduler.prefill_chunk_tokens for s in config(*argv).pool_specs()}


def test_decode_workers_take_small_prompt_chunks_and_the_router_plans_with_them():
    assert caps() == {PoolKind.PREFILL: 256, PoolKind.DECODE: 64}
    assert caps("--prefill-chunk-tokens", "1024", "--decode-prefill-chunk-tokens", "32") == {
        PoolKind.PREFILL: 1024, PoolKind.DECODE: 32}
    assert config("--decode-prefill-chunk-tokens", "32").router_config().local_chunk_tokens == 32


def test_colocated_workers_keep_the_prefill_cap():
    assert caps("--colocated-workers", "2", "--prefill-workers", "0", "--decode-workers", "0") == {
        PoolKind.COLOCATED: 256}


def test_a_negative_cap_names_the_flag():
    with pytest.raises(ValueError, match="--decode-prefill-chunk-tokens"):
        config("--decode-prefill-chunk-tokens", "-1")


def test_in_fifo_order_the_router_does_not_price_local_prefills_in_chunks():
    """(The engine caps prompt tokens per step in fair order only.)"""
    assert config("--prefill-order", "fifo").router_config().local_chunk_tokens == 0


def test_lower_classes_cap_reaches_every_pools_scheduler_and_a_negative_one_names_the_flag():
    def lower(*argv: str) -> set[int]:
        return {s.engine.scheduler.lower_class_chunk_tokens for s in config(*argv).pool_specs()}

    assert lower() == {128} and lower("--lower-class-chunk-tokens", "0") == {0}
    with pytest.raises(ValueError, match="--lower-class-chunk-tokens"):
        config("--lower-class-chunk-tokens", "-5")
