"""The decode pool's worker (and, without a KV transport, the colocated baseline worker)."""

from decode_worker.worker import DecodeWorker

__all__ = ["DecodeWorker"]
