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
])
def test_a_layout_spec_names_placement_and_prompt_order(spec, placement, local, order, label):
    layout = Layout.parse(spec)
    config = layout.serve_config(model="tiny-random")
    assert (config.placement, config.local_prefill, config.prefill_order, layout.label) == (
        placement, local, order, label)
    assert config.engine_config(2048).scheduler.prefill_order == order


def test_a_bad_layout_spec_says_what_is_expected():
    with pytest.raises(ValueError, match=":fifo or :fair"):
        Layout.parse("2p1d:lifo")
