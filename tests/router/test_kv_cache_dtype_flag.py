"""`pdserve serve --kv-cache-dtype`: every pool's cache takes it (KV moves between pools of one layout), and
a vLLM pool refuses it naming the flag."""

from __future__ import annotations

import pytest

from control.cli import build_parser, serve_config


def cache_dtypes(*argv: str) -> set[str | None]:
    config = serve_config(build_parser().parse_args(["serve", *argv]))
    return {s.engine.cache.dtype for s in config.pool_specs()}


def test_every_pool_takes_the_cache_dtype_and_the_default_is_the_models():
    assert cache_dtypes("--kv-cache-dtype", "bfloat16") == {"bfloat16"}
    assert cache_dtypes("--kv-cache-dtype", "fp8") == {"fp8"}  # vLLM's name for e4m3
    assert cache_dtypes() == {None}


def test_a_vllm_pool_or_an_unknown_dtype_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--kv-cache-dtype is the built-in engine's"):
        cache_dtypes("--kv-cache-dtype", "bfloat16", "--engine", "vllm")
    with pytest.raises(SystemExit):  # argparse: not a known dtype
        cache_dtypes("--kv-cache-dtype", "int8")
