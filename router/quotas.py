"""Tenants' quotas at the door: a request over its tenant's limit is refused before it is placed, so before
any prefill, with RESOURCE_EXHAUSTED (gRPC) / 429 (HTTP), a message naming the limit and a retry-after.

`QuotaGate.admit` checks, in order: concurrent requests, queued prompt tokens, tokens per minute; it returns
a `Ticket` that the stream carries (`router.streaming.stream_text`): `first_token` gives back the prompt's
queued tokens, `generated` charges the token bucket, `release` ends the request (idempotent, so every way
out may call it).

A refusal also marks whether the tenant came back before an earlier refusal's retry-after had passed
(`QuotaExceeded.ignored_retry_after`): the door answers those a little later (`Door.admit`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.tenants import Tenant

__all__ = ["QuotaExceeded", "QuotaGate", "Ticket"]


class QuotaExceeded(Exception):
    """Over a tenant's limit: `limit` names it (the flag-style field of the key file)."""

    def __init__(self, limit: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.ignored_retry_after = False  # the tenant was refused before, and its retry-after has not passed

    @property
    def retry_after(self) -> int:
        """Whole seconds, at least 1 (HTTP's Retry-After and gRPC's `retry-after` trailer)."""
        return max(1, math.ceil(self.retry_after_s))


@dataclass
class _Usage:
    """What one tenant holds right now."""

    in_flight: int = 0
    queued_prompt_tokens: int = 0
    bucket: float = 0.0  # tokens it may still spend (refilled at tokens_per_minute / 60 per second)
    refilled_at: float = 0.0
    retry_at: float = -math.inf  # when its latest refusal's retry-after passes


@dataclass(eq=False)
class Ticket:
    """One admitted request's hold on its tenant's quota."""

    gate: QuotaGate
    tenant: Tenant
    prompt_tokens: int
    queued: bool = True  # its prompt tokens still count as queued
    released: bool = field(default=False)

    def first_token(self) -> None:
        if self.queued:
            self.queued = False
            self.gate._usage(self.tenant).queued_prompt_tokens -= self.prompt_tokens

    def generated(self, n: int) -> None:
        if self.tenant.limits.tokens_per_minute is not None and n:
            self.gate._usage(self.tenant).bucket -= n

    def release(self) -> None:
        if self.released:
            return
        self.first_token()
        self.released = True
        self.gate._usage(self.tenant).in_flight -= 1


class QuotaGate:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_tenant: dict[str, _Usage] = {}

    def _usage(self, tenant: Tenant) -> _Usage:
        u = self._by_tenant.get(tenant.name)
        if u is None:
            tpm = tenant.limits.tokens_per_minute
            u = self._by_tenant[tenant.name] = _Usage(bucket=float(tpm or 0), refilled_at=self.clock())
        return u

    def held(self, tenant: Tenant) -> tuple[int, int]:
        """(requests in flight, queued prompt tokens) of `tenant`."""
        u = self._usage(tenant)
        return u.in_flight, u.queued_prompt_tokens

    def admit(self, tenant: Tenant, prompt_tokens: int) -> Ticket:
        """A ticket for one request of `prompt_tokens`, or QuotaExceeded naming the limit it would pass."""
        try:
            return self._admit(tenant, prompt_tokens)
        except QuotaExceeded as e:
            u, now = self._usage(tenant), self.clock()
            e.ignored_retry_after = now < u.retry_at
            u.retry_at = now + e.retry_after
            raise

    def _admit(self, tenant: Tenant, prompt_tokens: int) -> Ticket:
        limits = tenant.limits
        u = self._usage(tenant)
        cap = limits.max_concurrent_requests
        if cap is not None and u.in_flight >= cap:
            raise QuotaExceeded("max_concurrent_requests", f"tenant {tenant.name!r} has {u.in_flight} requests "
                                f"in flight, its limit max_concurrent_requests={cap}; retry when one ends", 1.0)
        cap = limits.max_queued_prompt_tokens
        if cap is not None and u.queued_prompt_tokens + prompt_tokens > cap:
            if prompt_tokens > cap:
                raise QuotaExceeded("max_queued_prompt_tokens", f"the prompt is {prompt_tokens} tokens, over "
                                    f"tenant {tenant.name!r}'s max_queued_prompt_tokens={cap}", 60.0)
            raise QuotaExceeded("max_queued_prompt_tokens", f"tenant {tenant.name!r} has "
                                f"{u.queued_prompt_tokens} prompt tokens waiting for prefill; this prompt's "
                                f"{prompt_tokens} would pass its max_queued_prompt_tokens={cap}", 1.0)
        tpm = limits.tokens_per_minute
        if tpm is not None:
            now = self.clock()
            rate = tpm / 60.0
            u.bucket = min(float(tpm), u.bucket + (now - u.refilled_at) * rate)
            u.refilled_at = now
            if prompt_tokens > tpm:
                raise QuotaExceeded("tokens_per_minute", f"the prompt is {prompt_tokens} tokens, over tenant "
                                    f"{tenant.name!r}'s tokens_per_minute={tpm}", 60.0)
            if u.bucket < prompt_tokens:
                raise QuotaExceeded("tokens_per_minute", f"tenant {tenant.name!r} spent its "
                                    f"tokens_per_minute={tpm}; {u.bucket:.0f} tokens left, the prompt needs "
                                    f"{prompt_tokens}", (prompt_tokens - u.bucket) / rate)
            u.bucket -= prompt_tokens
        u.in_flight += 1
        u.queued_prompt_tokens += prompt_tokens
        return Ticket(self, tenant, prompt_tokens)
