"""End to end over gRPC on the real SmolLM2: disaggregated greedy output equals the engine's own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import LLM, SamplingParams
from tests.serving.conftest import greedy_request, running_server, token_ids

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about the sea. "
    "Every morning the dragon would",
]
MAX_TOKENS = 24
SPEC_PROMPTS = PROMPTS + [
    "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "Here it is again:\n",
    "Quote it three times: 'the quick brown fox jumps over the lazy dog'. The quick",
]
SPEC_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    """The engine's own greedy outputs, for the plain and the speculative tests: one model load for both
    (no prefix caching, so the second set is computed as cold as the first)."""
    llm = LLM("smollm2-135m", num_blocks=64, enable_prefix_caching=False)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    spec = llm.generate(SPEC_PROMPTS, SamplingParams(max_tokens=SPEC_TOKENS, temperature=0))
    return {"plain": [o.token_ids for o in plain], "spec": [o.token_ids for o in spec]}


# (2P2D in the soak run: the default suite's 2P2D chaos test, tests/chaos, checks its streams' tokens against
# the engine's on this layout)
@pytest.mark.parametrize("layout", [
    {"prefill_workers": 1, "decode_workers": 1},
    pytest.param({"prefill_workers": 2, "decode_workers": 2}, marks=pytest.mark.soak),
    {"prefill_workers": 1, "decode_workers": 1, "local_prefill": True},
    {"prefill_workers": 0, "decode_workers": 0, "colocated_workers": 2},
], ids=["1P1D", "2P2D", "1P1D-local-prefill", "colocated"])
def test_greedy_output_equals_the_engine_token_for_token(ray_cluster, references, layout):
    reference = references["plain"]
    with running_server(model="smollm2-135m", num_blocks=128, **layout) as server:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrently, so the workers batch them
            results = list(pool.map(lambda p: server.generate(greedy_request(p, MAX_TOKENS)), PROMPTS))
        for prompt, want, responses in zip(PROMPTS, reference, results):
            assert token_ids(responses) == want, prompt
            last = responses[-1]
            assert last.usage.completion_tokens == len(want)
            assert "".join(r.text for r in responses) == server.server.servicer.tokenizer.decode(want)
            kinds = {"colocated": ("colocated", "colocated"), "local": ("decode", "decode"),
                     "remote": ("prefill", "decode")}[last.timing.placement]
            assert last.prefill_worker_id.startswith(kinds[0]) and last.decode_worker_id.startswith(kinds[1])
            want_placement = ("colocated" if "colocated_workers" in layout
                              else "local" if layout.get("local_prefill") else "remote")
            # NOTE: these prompts are short and the decode worker idle: prefilling there costs a fraction of
            # a decode step, so conditional disaggregation keeps every one of them local
            assert last.timing.placement == want_placement
        reports = server.wait_idle()
        assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values()), reports


# (colocated in the soak run: the default suite speculates in the decode pool here and in one engine in
# tests/engine/test_spec_decode.py)
@pytest.mark.parametrize("layout", [
    {"prefill_workers": 1, "decode_workers": 1},
    pytest.param({"prefill_workers": 0, "decode_workers": 0, "colocated_workers": 1}, marks=pytest.mark.soak),
], ids=["1P1D", "colocated"])
def test_speculative_greedy_output_equals_the_engine_and_is_counted(ray_cluster, references, layout):
    want = references["spec"]
    with running_server(model="smollm2-135m", num_blocks=128, speculative="ngram", num_speculative_tokens=4,
                        **layout) as server:
        # concurrently, so speculating sequences share steps with each other and with one that opted out
        requests = [greedy_request(p, SPEC_TOKENS, disable_speculation=i == 0)
                    for i, p in enumerate(SPEC_PROMPTS)]
        with ThreadPoolExecutor(len(SPEC_PROMPTS)) as pool:
            results = list(pool.map(server.generate, requests))
        for prompt, ids, responses in zip(SPEC_PROMPTS, want, results):
            assert token_ids(responses) == ids, prompt
            assert responses[-1].usage.completion_tokens == len(ids)
        reports = server.wait_idle()
        assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values()), reports
        registry = server.server.metrics.registry
        pool = "colocated" if "colocated_workers" in layout else "decode"

        def total(name: str) -> float:
            return sum(s.value for fam in registry.collect() for s in fam.samples
                       if s.name == name and s.labels.get("pool") == pool)

        assert total("pdserve_spec_accepted_tokens_total") > 0
        assert 0 < total("pdserve_spec_accepted_tokens_total") <= total("pdserve_spec_draft_tokens_total")
        assert total("pdserve_decode_tokens_total") > total("pdserve_decode_seq_steps_total")


def test_a_follow_up_over_an_answer_the_decode_worker_caches_passes_the_kv_check(ray_cluster):
    """A chat's next turn carries the last answer, whose KV the decode worker computed step by step and keeps
    in its prefix cache; the prefill worker computes the same positions in one pass, equal only to rounding.
    The decode worker's cached blocks are not sent, so `--verify-kv-moves` compares what was (it once
    compared every position, and failed each such turn on every retry)."""
    first_turn = "The capital of France is"
    with running_server(model="smollm2-135m", num_blocks=128, prefill_workers=1, decode_workers=1,
                        verify_kv_moves=True) as server:
        answer = token_ids(server.generate(greedy_request(first_turn, 48, ignore_eos=True)))
        tokenizer = server.server.servicer.tokenizer
        history = tokenizer.encode(first_turn) + answer
        next_turn = tokenizer.encode(" Now describe the city's history, its rivers, bridges and markets, "
                                     "the people who built them and the wars they survived." * 4)
        follow_up = server.generate(greedy_request(history + next_turn, 8))
        assert len(token_ids(follow_up)) == 8 and follow_up[-1].timing.placement == "remote"
        # the first turn's blocks the answer filled were cached on the decode worker, and not sent again
        cached = len(history) // 16 * 16
        first, second = server.server.router.kv_checks
        assert (first.start, second.start, second.num_tokens) == (0, cached, len(history + next_turn))
        assert first.equal and second.equal and second.dst_digest is not None
        reports = server.wait_idle()
        assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values()), reports
