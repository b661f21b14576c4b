"""A two-rank torch.distributed group for one (sender, receiver) pair, made without any global world.

`ProcessGroupGloo(PrefixStore(prefix, store), rank, 2, options)` directly: `dist.new_group` would need a
default world, which a pool that grows and shrinks never has. gloo carries every header and small payload
and, unless both caches are on different GPUs, the layers too; there, an NCCL group over the same prefix
carries the layers, and is only ever asked to receive what a gloo header announced.

Once formed, the group's gloo listener is sealed (`listener_seal`): connections that are not this pair's
are dropped, instead of piling up in gloo.

Every wait is bounded. NOTE: a gloo wait that times out closes the whole pair (gloo cannot cancel one
pending op), which the peer sees as a closed connection: a timed-out op means a dead link, on both sides.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store, Work

from kv_transfer import listener_seal
from kv_transfer.wire import LinkError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroupNCCL  # only in CUDA builds of torch

log = logging.getLogger(__name__)

SENDER_RANK, RECEIVER_RANK = 0, 1
# sender -> receiver messages, receiver -> sender replies, sender -> receiver payloads too large for a message.
# NOTE: large payloads on their own tag let the receiver keep the next messages' receives posted meanwhile.
TAG_MSG, TAG_REPLY, TAG_PAYLOAD = 0, 1, 2


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
        self._store, self._prefix = store, prefix
        self.gloo: ProcessGroupGloo | None = None
        self.nccl: ProcessGroupNCCL | None = None
        try:
            self.gloo = ProcessGroupGloo(PrefixStore(f"{prefix}/gloo", store), rank, 2, options)
            if nccl_device is not None:
                from torch.distributed import ProcessGroupNCCL

                nccl_options = ProcessGroupNCCL.Options()
                nccl_options._timeout = timedelta(seconds=timeout_s)
                self.nccl = ProcessGroupNCCL(PrefixStore(f"{prefix}/nccl", store), rank, 2, nccl_options)
        except Exception as e:  # RuntimeError from gloo/NCCL, or anything else: drop what formed
            self.close()
            self.forget_rendezvous()
            raise LinkError(f"cannot form the pair group {prefix}: {_short(e)}") from e
        self._seal_listener(rank, host)

    def _seal_listener(self, rank: int, host: str) -> None:
        """Stop gloo's listener taking connections: the pair is connected (the constructor returned).
        NOTE: reads this rank's rendezvous key, which the receiver deletes only after the first message
        (`forget_rendezvous`), so it is still there on both sides."""
        try:
            advertised = self._store.get(self._rendezvous_keys()[rank])
        except RuntimeError as e:  # the store is gone: the link works, its listener stays open
            log.warning("KV link %s: cannot read its gloo address to seal the listener: %s", self._prefix,
                        _short(e))
            return
        listener_seal.seal(advertised, host)

    def isend(self, t: torch.Tensor, tag: int) -> PendingOp:
        """Post a gloo send of a contiguous CPU tensor (kept alive until the op is waited for)."""
        try:
            return PendingOp(self, self._gloo().send([t], self.peer, tag), t, cuda=False)
        except RuntimeError as e:
            raise LinkError(_short(e)) from e

    def irecv(self, t: torch.Tensor, tag: int) -> PendingOp:
        """Post a gloo receive into a contiguous CPU tensor of exactly the sent size."""
        try:
            return PendingOp(self, self._gloo().recv([t], self.peer, tag), t, cuda=False)
        except RuntimeError as e:
            raise LinkError(_short(e)) from e

    def isend_nccl(self, t: torch.Tensor) -> PendingOp:
        try:
            return PendingOp(self, self._nccl().send([t], self.peer, 0), t, cuda=True)
        except RuntimeError as e:
            raise LinkError(_short(e)) from e

    def irecv_nccl(self, t: torch.Tensor) -> PendingOp:
        try:
            return PendingOp(self, self._nccl().recv([t], self.peer, 0), t, cuda=True)
        except RuntimeError as e:
            raise LinkError(_short(e)) from e

    def _gloo(self) -> ProcessGroupGloo:
        if self.gloo is None:  # closed by the other thread of the link
            raise LinkError("the link is closed")
        return self.gloo

    def _nccl(self) -> ProcessGroupNCCL:
        if self.nccl is None:
            raise LinkError("the link is closed" if self.gloo is None else "this link has no NCCL group")
        return self.nccl

    def forget_rendezvous(self) -> None:
        """Delete the link's rendezvous keys from the store, in the background.

        NOTE: gloo's rendezvous leaves one address key per rank (`<prefix>/gloo/0/<rank>`); without this
        the router's store would keep two keys for every link ever made. Call it once both sides are known
        to have formed the group (the receiver does, on the link's first message): deleting them as soon
        as the own group existed broke links still forming (gloo reads them later than its constructor).
        In a thread of its own because a store call ignores timeouts when the router hangs. If gloo renames
        the keys this is a no-op; NCCL's unique-id key is left (its name is NCCL's business, and there was
        no GPU to check it on): one small key per NCCL link.
        """
        store, keys = self._store, self._rendezvous_keys()

        def forget() -> None:
            for key in keys:
                with contextlib.suppress(RuntimeError):
                    store.delete_key(key)

        threading.Thread(target=forget, daemon=True, name="kv-rendezvous-cleanup").start()

    def _rendezvous_keys(self) -> list[str]:
        """gloo's address key of each rank, by rank (see `forget_rendezvous`)."""
        return [f"{self._prefix}/gloo/0/{rank}" for rank in (SENDER_RANK, RECEIVER_RANK)]

    def close(self) -> None:
        """Drop the groups. The peer's pending ops fail at once (closed connection), provided the link
        dropped its own pending ops first: a posted receive keeps the connection open."""
        nccl, self.nccl, self.gloo = self.nccl, None, None
        if nccl is not None:
            nccl.abort()


class PendingOp:
    """A posted send or receive; `wait` it (once) before touching its tensor again."""

    def __init__(self, group: PairGroup, work: Work, tensor: torch.Tensor, cuda: bool) -> None:
        self._group, self._work, self.tensor, self._cuda = group, work, tensor, cuda

    def wait(self, timeout_s: float) -> None:
        """Block until done; LinkError if it failed or took longer than `timeout_s` (which breaks the pair)."""
        try:
            if not self._cuda:
                self._work.wait(timedelta(seconds=timeout_s))
                return
            # NOTE: NCCL work completes on the GPU; poll it (with a growing pause) instead of a blocking
            # wait, and abort the communicator on timeout so no kernel stays stuck on a dead peer.
            deadline, pause = time.monotonic() + timeout_s, 1e-5
            while not self._work.is_completed():
                if time.monotonic() > deadline:
                    nccl = self._group.nccl  # once: another thread may close the group meanwhile
                    if nccl is not None:
                        nccl.abort()
                    raise LinkError(f"NCCL transfer unfinished after {timeout_s:.3g}s")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
            self._work.wait()  # raises the op's error, if any
        except LinkError:
            raise
        except RuntimeError as e:
            raise LinkError(_short(e)) from e
