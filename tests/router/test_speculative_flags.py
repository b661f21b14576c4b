"""`pdserve serve --speculative ngram --num-speculative-tokens k`: which pools speculate, and bad values."""

from __future__ import annotations

import pytest

from control.cli import build_parser, serve_config
from protocol import PoolKind


def specs(*argv: str) -> dict[PoolKind, object]:
    config = serve_config(build_parser().parse_args(["serve", *argv]))
    return {s.kind: s.engine.speculative for s in config.pool_specs()}


def test_decode_workers_speculate_and_prefill_workers_never_do():
    pools = specs("--speculative", "ngram", "--num-speculative-tokens", "3", "--max-draft-tokens-per-step", "12")
    assert pools[PoolKind.DECODE].method == "ngram" and pools[PoolKind.DECODE].num_speculative_tokens == 3
    assert pools[PoolKind.DECODE].max_draft_tokens_per_step == 12
    assert not pools[PoolKind.PREFILL].enabled


def test_colocated_workers_speculate_and_the_default_is_off():
    colocated = specs("--speculative", "ngram", "--colocated-workers", "1", "--prefill-workers", "0",
                      "--decode-workers", "0")
    assert colocated[PoolKind.COLOCATED].enabled
    assert not any(s.enabled for s in specs().values())


def test_a_bad_draft_count_names_the_flag():
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        specs("--speculative", "ngram", "--num-speculative-tokens", "0")
    with pytest.raises(ValueError, match="--max-draft-tokens-per-step"):
        specs("--speculative", "ngram", "--max-draft-tokens-per-step", "-1")
    with pytest.raises(SystemExit):  # argparse: not a known method
        specs("--speculative", "medusa")
