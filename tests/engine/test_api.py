"""The offline API: argument validation, sampling controls, prompts as text or ids."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tests.engine.helpers import make_engine


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", num_blocks=256, max_model_len=256)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": -3}, "seed"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("build, field", [
    (lambda: CacheConfig(block_size=0), "block_size"),
    (lambda: CacheConfig(memory_fraction=1.5), "memory_fraction"),
    (lambda: CacheConfig(device_share=0), "device_share"),
    (lambda: CacheConfig(memory_bytes=0), "memory_bytes must be >= 1"),
    (lambda: CacheConfig(num_blocks=8, memory_bytes=1 << 20), "num_blocks and memory_bytes .* set one"),
    (lambda: CacheConfig(memory_bytes=1 << 20, memory_fraction=0.5), "memory_bytes and memory_fraction"),
    (lambda: make_engine(num_blocks=None, memory_bytes=1000),
     r"memory_bytes \(--kv-cache-memory-bytes\) 1000 holds no KV block of \d+ bytes"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (lambda: EngineConfig(model="tiny-random", dtype="float8"), "dtype"),
    (lambda: CacheConfig(dtype="float8"),
     r"CacheConfig.dtype must be one of .*'fp8', 'fp8_e4m3', 'fp8_e5m2'"),
    # a cache narrower than the model only under float32 weights; vLLM keeps its own
    (lambda: EngineConfig(model="tiny-random", dtype="bfloat16", cache=CacheConfig(dtype="float16")),
     "CacheConfig.dtype 'float16' under a bfloat16 model"),
    # an 8-bit cache: not run on a GPU yet
    (lambda: EngineConfig(model="tiny-random", device="cuda", cache=CacheConfig(dtype="fp8")),
     "CacheConfig.dtype 'fp8' .* checked on the CPU only, not on cuda"),
    (lambda: EngineConfig(model="tiny-random", backend="vllm", cache=CacheConfig(dtype="bfloat16")),
     "kv-cache-dtype"),
])
def test_bad_configs_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


@pytest.mark.parametrize("kv_cache_dtype, shrink", [(None, 1), ("bfloat16", 2), ("fp8", 4), ("fp8_e5m2", 4)])
def test_a_cache_sized_in_bytes_holds_as_many_blocks_as_its_dtype_fits(kv_cache_dtype, shrink):
    full = make_engine(num_blocks=None, memory_bytes=1 << 20)
    per_block = full.cache_spec.bytes_per_block
    engine = make_engine(num_blocks=None, memory_bytes=1 << 20, kv_cache_dtype=kv_cache_dtype)
    assert engine.num_blocks == (1 << 20) // (per_block // shrink) == full.num_blocks * shrink
    assert engine.kv_cache.tensor.numel() * engine.kv_cache.tensor.element_size() <= 1 << 20


def test_llm_takes_the_cache_size_as_a_fraction_or_in_bytes():
    """Each by keyword into `CacheConfig` (a positional call once put the fraction in the bytes' place)."""
    by_bytes = LLM("tiny-random", kv_cache_memory_bytes=1 << 20, kv_cache_dtype="fp8").engine
    assert by_bytes.num_blocks == (1 << 20) // by_bytes.cache_spec.bytes_per_block
    assert LLM("tiny-random", memory_fraction=0.001).engine.num_blocks > 0


def test_unknown_model_name_is_refused():
    with pytest.raises(ValueError, match="model 'no-such-model'"):
        LLM("no-such-model")


@pytest.mark.parametrize("prompt, field", [
    ("", "prompt"),
    ([], "prompt"),
    ([1, 2, 100000], "prompt_token_ids"),
    ([-1], "prompt_token_ids"),
    ("x" * 300, "max_model_len"),
])
def test_bad_prompts_name_the_field_and_queue_nothing(llm, prompt, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_text_and_token_id_prompts_give_the_same_tokens(llm):
    text = "hello, pdserve"
    ids = llm.tokenizer.encode(text)
    a, b = llm.generate([text, ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert a.prompt_token_ids == ids and a.token_ids == b.token_ids and len(a.token_ids) == 10
    assert a.text == llm.tokenizer.decode(a.token_ids)


def test_same_seed_same_tokens_other_seed_other_tokens(llm):
    def run(seed):
        p = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate(["sample me"], p)[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_seeded_sample_does_not_depend_on_batch_neighbours(llm):
    p = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    alone = llm.generate(["neighbours"], p)[0].token_ids
    batched = llm.generate(["neighbours", "other text here", "x"], p)[0].token_ids
    assert alone == batched


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    for p in (SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=0, ignore_eos=True)):
        assert llm.generate(["abc"], p)[0].token_ids == greedy


def test_stop_token_ids_and_max_tokens_finish_reasons(llm):
    free = llm.generate(["stop test"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason.value == "length" and len(free.token_ids) == 8
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = llm.generate(["stop test"], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason.value == "stop" and out.token_ids == free.token_ids[:first + 1]


def test_eos_stops_unless_ignore_eos(llm, monkeypatch):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    free = llm.generate(["eos test"], greedy)[0].token_ids
    # make the model's second greedy token the EOS id
    monkeypatch.setattr(llm.engine, "eos_token_ids", (free[1],))
    stopped = llm.generate(["eos test"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert stopped.finish_reason.value == "stop" and stopped.token_ids == free[:free.index(free[1]) + 1]
    assert llm.generate(["eos test"], greedy)[0].token_ids == free
    assert llm.engine.allocator.num_used_blocks == 0


def test_an_engine_loop_that_dies_ends_its_process():
    """An exception outside a step (here in `poll`) must end the worker process, not leave a live actor
    with a dead engine thread: the default `on_fatal` exits with status 70."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_run_a_loop_whose_poll_raises)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 70


def test_a_step_that_finds_its_engine_dead_ends_the_process_but_another_failed_step_does_not():
    """A step raising `EngineDead` (vLLM: a rank's process died, every later step would fail) ends the
    worker so it is replaced; any other failed step fails its requests and the loop steps on."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    outcomes = []
    for error in ("EngineDead", "RuntimeError"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_run_a_loop_whose_step_raises, args=(error, queue))
        proc.start()
        proc.join(120)
        outcomes.append((proc.exitcode, queue.get(timeout=10) if not queue.empty() else None))
    assert outcomes == [(70, None), (0, "stepped on after a failed step")], outcomes


def _run_a_loop_whose_step_raises(error: str, queue) -> None:
    import time

    from engine.backend import EngineDead
    from engine.engine_loop import EngineLoop
    from engine.sampling_params import SamplingParams
    from tests.engine.helpers import make_engine

    engine = make_engine(num_blocks=8)
    real_step, calls = engine.step, []

    def step(hook=None):
        calls.append(1)
        if len(calls) == 1:
            raise EngineDead("a rank died") if error == "EngineDead" else RuntimeError("one bad step")
        return real_step(hook)

    engine.step = step
    outputs = []
    loop = EngineLoop(engine, on_step=outputs.append)
    loop.start()
    loop.call(lambda: engine.enqueue(engine.make_request("a", [1, 2, 3], SamplingParams(max_tokens=2))))
    deadline = time.monotonic() + 60
    while not calls and time.monotonic() < deadline:  # the process ends here on EngineDead
        time.sleep(0.01)
    loop.call(lambda: engine.enqueue(engine.make_request("b", [1, 2, 3], SamplingParams(max_tokens=2))))
    while time.monotonic() < deadline:
        if any(d.request_id == "b" and d.finish_reason is not None for out in outputs for d in out.deltas):
            queue.put("stepped on after a failed step")
            break
        time.sleep(0.01)
    loop.shutdown()


def _run_a_loop_whose_poll_raises() -> None:
    import time

    from engine.engine_loop import EngineLoop
    from tests.engine.helpers import make_engine

    def poll() -> bool:
        raise RuntimeError("a bug in the KV poll")

    EngineLoop(make_engine(num_blocks=8), on_step=lambda out: None, poll=poll).start()
    time.sleep(60)  # the loop thread ends the process long before this
