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


def test_a_layout_may_name_its_kv_cache_dtype_beside_one_memory_size_for_all():
    """`1c:kv-fp8` beside `1c` under one `--kv-cache-memory-bytes`: each worker's config takes the layout's
    dtype and the bytes (the blocks those hold: `tests/engine/test_api.py`); vLLM layouts keep their own."""
    fp8 = Layout.parse("1c:kv-fp8")
    assert (fp8.label, Layout.parse(fp8.label)) == ("1c:kv-fp8", fp8)
    assert "KV cache in fp8" in fp8.description
    memory = 1 << 20
    configs = {spec: Layout.parse(spec).serve_config(model="tiny-random", kv_cache_memory_bytes=memory)
               for spec in ("1c", "1c:kv-fp8", "2p1d:kv-bfloat16")}
    caches = {spec: c.engine_config(512).cache for spec, c in configs.items()}
    assert {spec: (c.dtype, c.memory_bytes) for spec, c in caches.items()} == {
        "1c": (None, memory), "1c:kv-fp8": ("fp8", memory), "2p1d:kv-bfloat16": ("bfloat16", memory)}
    with pytest.raises(ValueError, match=":kv-DTYPE"):
        Layout.parse("1c:kv-int4")
    with pytest.raises(ValueError, match=":kv-fp8 is the built-in engine's KV cache dtype"):
        Layout.parse("1p1d:kv-fp8:vllm")
