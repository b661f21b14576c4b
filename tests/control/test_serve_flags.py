"""`pdserve serve`'s front-door flags reach the config, and a bad value is refused naming the flag."""

from __future__ import annotations

import pytest

from control.cli import build_parser, serve_config


def config(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_the_http_connection_cap_per_client_defaults_to_256_and_0_turns_it_off():
    assert config().http_max_connections_per_client == 256
    assert config("--http-max-connections-per-client", "0").http_max_connections_per_client == 0
    with pytest.raises(ValueError, match="--http-max-connections-per-client must be >= 0"):
        config("--http-max-connections-per-client", "-1")


def test_a_header_timeout_of_zero_is_refused_naming_the_flag():
    assert config("--http-header-timeout", "2.5").http_header_timeout == 2.5
    with pytest.raises(ValueError, match="--http-header-timeout must be > 0"):
        config("--http-header-timeout", "0")


def test_a_model_family_the_built_in_engine_cannot_run_stops_serve_before_any_door_or_worker(tmp_path):
    """An operator brings a Gemma checkpoint and forgets `--engine vllm`: refused at once, naming the family
    and the flag, where each worker would otherwise fail to load it in turn."""
    import asyncio
    import json

    from control.config import ServeConfig
    from control.console import ServeError
    from control.server import Server

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 300,
        "max_position_embeddings": 512}))
    server = Server(ServeConfig(model=str(tmp_path), port=0, metrics_port=None, http_port=None))
    with pytest.raises(ServeError, match=r"--model .*'gemma3_text'.*--engine vllm"):
        asyncio.run(server.start())
    assert server.grpc is None


def test_the_engines_a_deployment_runs_are_those_of_its_pools():
    from control.config import ServeConfig

    assert ServeConfig(model="m", prefill_engine="vllm", decode_engine="vllm").engines() == {"vllm"}
    assert ServeConfig(model="m").engines() == {"builtin"}
    assert ServeConfig(model="m", engine="vllm", prefill_workers=0, decode_workers=0,
                       colocated_workers=1).engines() == {"vllm"}


def test_the_kv_cache_is_sized_by_blocks_or_by_bytes_not_both():
    assert config("--kv-cache-memory-bytes", "1048576").engine_config(512).cache.memory_bytes == 1 << 20
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes must be >= 1, got 0"):
        config("--kv-cache-memory-bytes", "0")
    with pytest.raises(ValueError, match="--num-blocks and --kv-cache-memory-bytes both size each worker's"):
        config("--kv-cache-memory-bytes", "1048576", "--num-blocks", "64")


def test_a_kv_cache_too_small_for_one_block_stops_serve_before_any_door_or_worker():
    """`--kv-cache-memory-bytes` under one block of the model's: refused at once, naming the flag and the
    least it needs, where each worker would otherwise fail to start in turn."""
    import asyncio

    from control.config import ServeConfig
    from control.console import ServeError
    from control.server import Server

    server = Server(ServeConfig(model="tiny-random", kv_cache_memory_bytes=1000, port=0, metrics_port=None,
                                http_port=None))
    with pytest.raises(ServeError, match=r"--kv-cache-memory-bytes 1000 holds no KV block of tiny-random "
                                         r"\(\d+ bytes at the least\)"):
        asyncio.run(server.start())
    assert server.grpc is None


def test_quantization_gguf_over_an_hf_directory_stops_serve_before_any_door_or_worker():
    import asyncio

    from control.config import ServeConfig
    from control.console import ServeError
    from control.server import Server

    server = Server(ServeConfig(model="tiny-random", quantization="gguf", port=0, metrics_port=None,
                                http_port=None))
    with pytest.raises(ServeError, match=r"--quantization gguf needs a \.gguf checkpoint, and 'tiny-random' "
                                         r"is an HF directory"):
        asyncio.run(server.start())
    assert server.grpc is None


def test_a_model_whose_heads_do_not_split_over_the_ranks_stops_serve_before_any_door_or_worker(tmp_path):
    """SmolLM2's 9 query and 3 KV heads split over 1, 3 or 9 ranks: `-tp 2` is refused at once, naming the
    flag, the heads and the sizes that work (vLLM refuses it in every worker, a traceback each)."""
    import asyncio
    import json

    from control.config import ServeConfig
    from control.console import ServeError
    from control.server import Server
    from engine.hub import resolve_model
    from engine.model_files import tensor_parallel_refusal

    smollm2 = resolve_model("smollm2-135m")
    assert tensor_parallel_refusal(smollm2, 3) is None
    assert tensor_parallel_refusal(smollm2, 2) == ("its 9 query heads and 3 KV heads do not split over 2 "
                                                   "ranks (sizes that do: 1, 3, 9)")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 2}))
    # fewer KV heads than ranks: vLLM keeps each on several ranks, a whole number of them
    assert [n for n in (1, 2, 3, 4, 8) if tensor_parallel_refusal(tmp_path, n) is None] == [1, 2, 4, 8]
    server = Server(ServeConfig(model="smollm2-135m", engine="vllm", decode_tensor_parallel_size=2, port=0,
                                metrics_port=None, http_port=None))
    with pytest.raises(ServeError, match=r"--decode-tensor-parallel-size 2: --model smollm2-135m: its 9 "
                                         r"query heads and 3 KV heads do not split over 2 ranks "
                                         r"\(sizes that do: 1, 3, 9\)"):
        asyncio.run(server.start())
    assert server.grpc is None
