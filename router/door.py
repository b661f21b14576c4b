"""What both front doors (gRPC and HTTP) do the same way before and around a request: who the caller is
(`KeyTable`), validation with the caller's cache salt and priority class, tokenization of large inputs off
the event loop, the caller's quotas (`QuotaGate`), and the stalled-stream watch (`StallWatch`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from protos.pdserve.v1 import generation_pb2 as pb
from router.quotas import QuotaExceeded, QuotaGate, Ticket
from router.stall_watch import StallWatch
from router.tenants import ANONYMOUS, KeyTable, Tenant
from router.validation import Limits, PromptTokenizer, ValidatedRequest, validate_request

__all__ = ["Door", "incident_id"]

# NOTE: inputs past this many characters are tokenized on a worker thread: a 262k-character prompt takes the
# tokenizer ~0.1 s, which on the event loop would stall every other stream's tokens; below it, the thread
# hop (~50 us) costs more than the tokenizer
OFF_LOOP_CHARS = 8192
# NOTE: a refusal for a tenant still inside an earlier refusal's retry-after (its clients ignore it) is answered
# this much later. The wait costs the event loop nothing, and a closed loop of such clients then sends a
# fraction of the requests: 12 of them sent ~900 a second, each refusal's parsing, tokenizing and reply
# taken from the cores that serve everyone else (benchmarks/tenant_bench.py). Short enough that a refusal
# still comes within 100 ms.
REPEAT_REFUSAL_DELAY_S = 0.04


def _input_chars(request: pb.GenerateRequest) -> int:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return len(request.prompt)
    if kind == "messages":
        return sum(len(m.content) for m in request.messages.messages)
    return 0


def incident_id() -> str:
    """An id for an internal error: the client is told it, the log holds the details under it."""
    return uuid.uuid4().hex[:12]


class Door:
    def __init__(self, limits: Limits, tokenizer: PromptTokenizer, keys: KeyTable | None = None,
                 stalls: StallWatch | None = None, quotas: QuotaGate | None = None) -> None:
        """`keys`: None -> every caller is the `default` tenant (no key required); `stalls`: None -> streams
        are never cancelled for stalling."""
        self.limits = limits
        self.tokenizer = tokenizer
        self.keys = keys
        self.stalls = stalls
        self.quotas = quotas or QuotaGate()

    def caller(self, authorization: str | bytes) -> Tenant | None:
        """The tenant an `Authorization` header names; None when the server has keys and this is none of them."""
        if self.keys is None:
            return ANONYMOUS
        return self.keys.lookup(authorization)

    async def validate(self, request: pb.GenerateRequest, tenant: Tenant) -> ValidatedRequest:
        """`validate_request` (InvalidArgument names the field), with the tenant's salt and priority cap."""
        if _input_chars(request) > OFF_LOOP_CHARS:
            req = await asyncio.to_thread(validate_request, request, self.limits, self.tokenizer)
        else:
            req = validate_request(request, self.limits, self.tokenizer)
        salt = req.cache_salt or tenant.cache_salt
        priority = min(req.priority, tenant.limits.priority)
        if salt == req.cache_salt and priority == req.priority:
            return req
        return dataclasses.replace(req, cache_salt=salt, priority=priority,
                                   params=dataclasses.replace(req.params, cache_salt=salt, priority=priority))

    async def admit(self, tenant: Tenant, req: ValidatedRequest) -> Ticket:
        """The request's hold on its tenant's quota; QuotaExceeded names the limit it would pass (after
        REPEAT_REFUSAL_DELAY_S when the tenant ignored an earlier refusal's retry-after)."""
        try:
            return self.quotas.admit(tenant, req.num_prompt_tokens)
        except QuotaExceeded as e:
            if e.ignored_retry_after:
                await asyncio.sleep(REPEAT_REFUSAL_DELAY_S)
            raise
