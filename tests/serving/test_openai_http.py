"""The OpenAI-compatible HTTP door, through the official `openai` client (sync and async, chat and
completions, streaming and not), on a real deployment of SmolLM2 next to the gRPC door: the same greedy
text and token counts, OpenAI's error shapes, and a disconnect that frees every block."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import openai
import pytest

from protos.pdserve.v1 import generation_pb2 as pb
from tests.serving.conftest import greedy_request, running_server, token_ids

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(ray_cluster):
    # max_queue=0 and 128 blocks: a 3,000-token prompt can never be placed (a 400: retrying cannot help)
    with running_server(model=MODEL, num_blocks=128, max_queue=0) as s:
        yield s


def base_url(server) -> str:
    return f"http://127.0.0.1:{server.server.http_port}/v1"


def grpc_text(server, request: pb.GenerateRequest) -> tuple[str, int, int]:
    out = server.generate(request)
    return "".join(r.text for r in out), out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens


def test_completions_equal_the_grpc_door_streaming_and_not(server):
    client = openai.OpenAI(base_url=base_url(server), api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    for prompt in PROMPTS:
        want, prompt_tokens, completion_tokens = grpc_text(server, greedy_request(prompt, 12, ignore_eos=True))
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_tokens, completion_tokens)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_and_stop_strings(server):
    client = openai.OpenAI(base_url=base_url(server), api_key="unused")
    ids = server.server.servicer.tokenizer.encode(PROMPTS[0])
    want = token_ids(server.generate(greedy_request(ids, 8, ignore_eos=True)))
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == server.server.servicer.tokenizer.decode(want)
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=["."])
    assert "." not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_chat_equals_the_grpc_door_with_the_async_client(server):
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT])
    want, prompt_tokens, completion_tokens = grpc_text(server, pb.GenerateRequest(
        messages=msgs, sampling=pb.SamplingParams(max_tokens=16, temperature=0)))

    async def go():
        client = openai.AsyncOpenAI(base_url=base_url(server), api_key="unused")
        whole = await client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16,
                                                     temperature=0)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(go())
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == want
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


def test_errors_have_openais_status_and_shape(server):
    client = openai.OpenAI(base_url=base_url(server), api_key="unused", max_retries=0)
    cases = [
        (dict(model="gpt-4o", prompt="a"), openai.NotFoundError, "model", "model_not_found"),
        (dict(model=MODEL, prompt="a", temperature=-1), openai.BadRequestError, "temperature", None),
        (dict(model=MODEL, prompt="a", n=2), openai.BadRequestError, "n", "unsupported_parameter"),
        (dict(model=MODEL, prompt="a", logprobs=2), openai.BadRequestError, "logprobs", "unsupported_parameter"),
        (dict(model=MODEL, prompt="a", max_tokens=0), openai.BadRequestError, "max_tokens", None),
        (dict(model=MODEL, prompt="a", max_tokens=10**6), openai.BadRequestError, "max_tokens", None),
        (dict(model=MODEL, prompt="a", max_tokens=10**20), openai.BadRequestError, "max_tokens", None),
        (dict(model=MODEL, prompt=""), openai.BadRequestError, "prompt", None),
    ]
    for kwargs, error, param, code in cases:
        with pytest.raises(error) as e:
            client.completions.create(**kwargs)
        body = e.value.body
        assert body["param"] == param and body["code"] == code and body["message"], (kwargs, body)
        if kwargs.get("max_tokens") == 10**20:  # the number the client sent, not the proto field's clamp
            assert "got 100000000000000000000" in body["message"], body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert e.value.body["param"] == "messages[0].role" and "robot" in e.value.body["message"], e.value.body
    # no model named: the one this server serves, as vLLM does
    req = urllib.request.Request(base_url(server) + "/completions", method="POST",
                                 data=json.dumps({"prompt": "a", "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        got = json.loads(r.read())
    assert got["model"] == MODEL and got["usage"]["completion_tokens"] == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}])
    assert e.value.body["param"] == "tools" and "tools" in e.value.body["message"]
    rng = random.Random(0)
    with pytest.raises(openai.BadRequestError) as e:  # more KV blocks than any decode worker has: never fits
        client.completions.create(model=MODEL, prompt=[rng.randrange(100, 40000) for _ in range(3000)],
                                  max_tokens=4)
    assert "KV blocks" in e.value.body["message"] and e.value.body["param"] == "prompt"


def test_a_draining_server_answers_503_in_openais_shape(server):
    client = openai.OpenAI(base_url=base_url(server), api_key="unused", max_retries=0)
    server.server.router.draining = True  # as after SIGTERM: nothing new is admitted
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "unavailable"
        assert "shutting down" in e.value.body["message"]
    finally:
        server.server.router.draining = False
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2).usage.completion_tokens == 2


def cancelled(server) -> float:
    return server.server.metrics.registry.get_sample_value(
        "pdserve_requests_total", {"model": MODEL, "finish_reason": "cancelled"}) or 0.0


def test_a_client_that_disconnects_mid_stream_frees_every_block(server):
    client = openai.OpenAI(base_url=base_url(server), api_key="unused")
    before = cancelled(server)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream, 1):
        if n == 3:  # three chunks in, the client goes away
            break
    stream.close()
    reports = server.wait_idle(30)
    for wid, r in reports.items():
        assert r.load.free_blocks == r.load.total_blocks and r.load.num_running == 0, (wid, r.load)
    assert cancelled(server) == before + 1  # cancelled, not run to its 400 tokens
