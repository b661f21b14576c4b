"""What the router reports as requests move through it: the seam metrics hang off.

The base class does nothing; `router.metrics.Metrics` implements it. Every hook runs on the router's event
loop and must not block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.messages import KVMoveResult, LoadReport
    from router.cost_model import CostModel
    from router.registry import Worker
    from router.router import RequestState, RouterEvent
    from router.validation import ValidatedRequest


class RequestObserver:
    def watch_cost(self, cost: CostModel) -> None:
        """The router's cost model (`router.cost_model`), to be read whenever its numbers are wanted."""

    def on_event(self, req: ValidatedRequest, state: RequestState, event: RouterEvent) -> None:
        """Tokens reached the client: `event.first` marks the first (TTFT), later ones give ITL gaps."""

    def on_end(self, req: ValidatedRequest, state: RequestState | None, outcome: str,
               completion_tokens: int) -> None:
        """The stream ended: outcome is "stop", "length", "cancelled" or "error". `state` is None when the
        request failed before the router took it (admission, duplicate id)."""

    def on_report(self, worker: Worker, report: LoadReport) -> None:
        """A worker's fresh load (running, waiting, KV blocks) reached the router."""

    def on_cache_resync(self, worker: Worker) -> None:
        """The router's picture of a worker's prefix cache was rebuilt from a full snapshot (it had fallen
        behind the worker's change log)."""

    def on_worker_lost(self, worker: Worker) -> None:
        """A worker is gone (its node left, it crashed, it was declared dead): its load is no longer current."""

    def on_migration(self, state: RequestState, cause: str, method: str) -> None:
        """The request leaves its worker (`router.lifecycle.Cause`: a failure, or a drain) to go on elsewhere
        by `method` (`router.lifecycle.Method`), or fails past the migration limit."""

    def on_migration_pause(self, method: str, seconds: float) -> None:
        """A migrated stream's first tokens after the move reached the client, `seconds` after its last before."""

    def on_kv_move(self, src: str, dst: str, result: KVMoveResult) -> None:
        """A drained sequence's KV move from decode worker `src` to `dst` ended."""

    def on_placement(self, path: str) -> None:
        """A disaggregated attempt was placed: `path` is "remote" (prefill pool + KV transfer) or "local"
        (prefilled by its decode worker)."""

    def on_pool_size(self, pool: str, live: int, target: int, backoff_s: float = 0.0) -> None:
        """A pool's live workers against its target size, and how long its next replacement must wait
        (`PoolManager.backoff_left`), refreshed on every liveness tick."""

    def on_kv_transfer(self, src: str, dst: str, seconds: float, num_bytes: int, ok: bool) -> None:
        """A prompt's KV transfer ended: `seconds` from opening it to the last layer acknowledged."""

    def on_stalled_stream(self, door: str) -> None:
        """A stream whose client took no token for --stalled-stream-timeout was cancelled (`door`: grpc, http)."""

    def on_quota_refused(self, tenant: str, limit: str) -> None:
        """A request of `tenant` was refused at the door: over its `limit` (`router.quotas`)."""
