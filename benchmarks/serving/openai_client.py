"""The bench's OpenAI backend: the same workloads and records over HTTP, against any OpenAI-compatible
server (pdserve's `/v1`, vLLM, SGLang, ...).

Each request is a streamed `POST /v1/completions` with the workload's token ids as the prompt, greedy,
`ignore_eos` (the common extension) and `stream_options.include_usage`. Every chunk with a choice counts as
one token message (servers send one per decode step), timed on arrival exactly as the gRPC client times
messages; the final usage chunk gives the server's own token counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from benchmarks.serving.client import CANCELLED, RequestRecord
from benchmarks.serving.workloads import RequestSpec

DEFAULT_VOCAB = 32000  # token ids drawn below this when the server does not say its vocabulary size


@dataclass
class ModelCard:
    id: str
    max_model_len: int | None
    vocab_size: int


class OpenAIBackend:
    """One OpenAI-compatible server: `base_url` like http://HOST:PORT (the /v1 is added)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, api_key: str | None = None,
                 model: str | None = None) -> None:
        self.session = session
        self.base = base_url.rstrip("/").removesuffix("/v1") + "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model

    async def describe(self) -> ModelCard:
        async with self.session.get(f"{self.base}/models", headers=self.headers) as r:
            if r.status != 200:
                raise ValueError(f"{self.base}/models answered {r.status}: {(await r.text())[:300]}")
            models = (await r.json())["data"]
        card = next((m for m in models if self.model in (None, m["id"])), None)
        if card is None:
            raise ValueError(f"--model {self.model!r} is not served at {self.base}: {[m['id'] for m in models]}")
        self.model = card["id"]
        return ModelCard(card["id"], card.get("max_model_len"), card.get("vocab_size") or DEFAULT_VOCAB)

    async def send_one(self, spec: RequestSpec, record: RequestRecord, request_id: str, timeout_s: float) -> None:
        """Stream one request into `record`; never raises but CancelledError (errors land in record.error)."""
        body = {"model": self.model, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "user": request_id}
        record.sent_at = time.perf_counter()
        try:
            async with self.session.post(f"{self.base}/completions", json=body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    record.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                    return
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    now = time.perf_counter()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = f"stream error: {chunk['error'].get('message')}"
                        return
                    for choice in chunk.get("choices") or ():
                        record.on_message(now, 1)
                        if choice.get("finish_reason"):
                            record.done_at, record.finish_reason = now, choice["finish_reason"].upper()
                    usage = chunk.get("usage")
                    if usage:
                        record.cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens", 0) or 0
                        # NOTE: a chunk is one step's tokens, but a router catching up on a slow stream merges
                        # the steps already queued into one chunk: the server's own count is the truth, and
                        # the uncounted tokens arrived no later than this
                        missing = (usage.get("completion_tokens") or 0) - len(record.token_times)
                        if missing > 0:
                            record.on_message(now, missing)
            if record.done_at is None:
                record.error = "stream ended without a finish_reason"
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            record.error = f"{type(e).__name__}: {e}"
        except asyncio.CancelledError:
            record.error = CANCELLED
            raise
