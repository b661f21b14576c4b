"""The prefill pool's worker: prompts in, first tokens out, KV pushed to the decode pool."""

from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker"]
