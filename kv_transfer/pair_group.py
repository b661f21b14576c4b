"""A two-rank torch.distributed group for one (sender, receiver) pair, made without any global world.

`ProcessGroupGloo(PrefixStore(prefix, store), rank, 2, options)` directly: `dist.new_group` would need a
default world, which a pool that grows and shrinks never has. gloo carries every header and small payload
and, unless both caches are on different GPUs, the layers too; there, an NCCL group over the same prefix
carries the layers, and is only ever asked to receive what a gloo header announced.

Every wait is bounded. NOTE: a gloo wait that times out closes the whole pair (gloo cannot cancel one
pending op), which the peer sees as a closed connection: a timed-out op means a dead link, on both sides.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

from kv_transfer.wire import LinkError

SENDER_RANK, RECEIVER_RANK = 0, 1
TAG_DATA, TAG_REPLY = 0, 1  # sender -> receiver, receiver -> sender


def _short(e: BaseException) -> str:
    """gloo's messages start with a source location and end with advice; keep the middle."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0]


class PairGroup:
    """The process group(s) of one link, as seen from one side (`rank`)."""

    def __init__(self, store: Store, prefix: str, rank: int, host: str, timeout_s: float,
                 nccl_device: torch.device | None) -> None:
        assert rank in (SENDER_RANK, RECEIVER_RANK), f"a pair has ranks 0 and 1, got {rank}"
        self.peer = 1 - rank
        self.nccl_device = nccl_device
        options = ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]  # bind to this node's address
        try:
            self.gloo = ProcessGroupGloo(PrefixStore(f"{prefix}/gloo", store), rank, 2, options)
            self.nccl = None
            if nccl_device is not None:
                from torch.distributed import ProcessGroupNCCL

                nccl_options = ProcessGroupNCCL.Options()
                nccl_options._timeout = timedelta(seconds=timeout_s)
                self.nccl = ProcessGroupNCCL(PrefixStore(f"{prefix}/nccl", store), rank, 2, nccl_options)
        except RuntimeError as e:
            raise LinkError(f"cannot form the pair group {prefix}: {_short(e)}") from e

    def send(self, t: torch.Tensor, tag: int, timeout_s: float) -> None:
        """gloo send of a contiguous CPU tensor."""
        try:
            self.gloo.send([t], self.peer, tag).wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise LinkError(_short(e)) from e

    def recv(self, t: torch.Tensor, tag: int, timeout_s: float) -> None:
        """gloo receive into a contiguous CPU tensor of exactly the sent size."""
        try:
            self.gloo.recv([t], self.peer, tag).wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise LinkError(_short(e)) from e

    def send_nccl(self, t: torch.Tensor, timeout_s: float) -> None:
        assert self.nccl is not None
        self._wait_cuda(lambda: self.nccl.send([t], self.peer, 0), timeout_s)

    def recv_nccl(self, t: torch.Tensor, timeout_s: float) -> None:
        assert self.nccl is not None
        self._wait_cuda(lambda: self.nccl.recv([t], self.peer, 0), timeout_s)

    def _wait_cuda(self, start, timeout_s: float) -> None:
        # NOTE: NCCL work completes on the GPU; poll it (with a growing pause) instead of a blocking wait,
        # and abort the communicator on timeout so the kernel cannot stay stuck on a dead peer.
        assert self.nccl is not None
        try:
            work = start()
            deadline, pause = time.monotonic() + timeout_s, 1e-5
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self.nccl.abort()
                    raise LinkError(f"NCCL transfer unfinished after {timeout_s:.3g}s")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
            work.wait()  # raises the op's error, if any
        except RuntimeError as e:
            if isinstance(e, LinkError):
                raise
            raise LinkError(_short(e)) from e

    def close(self) -> None:
        """Drop the groups; the peer's pending ops fail at once (closed connection)."""
        if self.nccl is not None:
            self.nccl.abort()
        self.nccl = None
        self.gloo = None
