"""`pdserve bench --launch` layouts: each spec becomes the ServeConfig it names, and a bad one says what is
expected."""

from __future__ import annotations

import pytest

from benchmarks.serving.launch import Layout


@pytest.mark.parametrize("spec, placement, local, order, label", [
    ("2p1d", "joint", False, "fair", "2p1d"),
    ("2p1d:fifo", "joint", False, "fifo", "2p1d:fifo"),
    ("2p1d:separate:fifo", "separate", False, "fifo", "2p1d:separate:fifo"),
    ("1p1d:local", "joint", True, "fair", "1p1d:local"),
    ("1p1d:local:dchunk0", "joint", True, "fair", "1p1d:local:dchunk0"),
])
def test_a_layout_spec_names_placement_and_prompt_order(spec, placement, local, order, label):
    layout = Layout.parse(spec)
    config = layout.serve_config(model="tiny-random")
    assert (config.placement, config.local_prefill, config.prefill_order, layout.label) == (
        placement, local, order, label)
    assert config.engine_config(2048).scheduler.prefill_order == order


def test_early_reserves_decode_blocks_at_placement():
    assert Layout.parse("2p1d").serve_config(model="tiny-random").late_reservation
    early = Layout.parse("2p1d:chunk256:early")
    assert early.label == "2p1d:chunk256:early" and not early.serve_config(model="tiny-random").late_reservation
    assert Layout.parse(early.label) == early


def test_a_bad_layout_spec_says_what_is_expected():
    with pytest.raises(ValueError, match=":fifo or :fair"):
        Layout.parse("2p1d:lifo")


def test_a_layout_may_set_the_workers_prompt_tokens_per_step():
    assert Layout.parse("2p1d:local").serve_config(model="tiny-random").decode_prefill_chunk_tokens == 64
    assert Layout.parse("2p1d:local:fair:dchunk0").serve_config(model="tiny-random").decode_prefill_chunk_tokens == 0
    chunked = Layout.parse("2p1d:chunk256")
    assert (chunked.label, chunked.serve_config(model="tiny-random").prefill_chunk_tokens) == ("2p1d:chunk256", 256)
