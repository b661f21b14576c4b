"""The torch transport against a hostile network: frame headers that name absurd sizes, and stray connections.

A peer that holds the deployment's secret can still send any header; anything on the network can connect to
a link's gloo listener. Real gloo pairs on loopback, both ends in this process.
"""

from __future__ import annotations

import os
import socket
import time

import torch
from kvx_harness import HOST
from test_kvx_inprocess import SPEC, accept_queue, landed, make_pair, start, transfer_lands

from kv_transfer.layout import TransferDescriptor
from kv_transfer.pair_group import SENDER_RANK, TAG_MSG, TAG_REPLY, PairGroup
from kv_transfer.rendezvous import LinkRequest, link_prefix
from kv_transfer.torch_links import _Where
from kv_transfer.wire import HEADER_LEN, Header, MsgKind

_GiB = 1 << 30


def _vm_peak() -> int:
    """This process's peak virtual memory, bytes: an allocation shows here even before it is touched."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmPeak:"))
    return kib << 10


def _rogue_link(p, port: int, name: str) -> tuple[PairGroup, float]:
    """A link to the pair's receiver, opened with the deployment's secret, but driven by hand."""
    cfg, store, queue = accept_queue(p, port)
    request = LinkRequest.signed("mallory", name, "cpu", queue, cfg.secret)
    store.queue_push(queue, request.to_json())
    return PairGroup(store, link_prefix(cfg.namespace, name), SENDER_RANK, HOST, cfg.connect_timeout_s,
                     None), cfg.op_timeout_s


def _send(group: PairGroup, header: Header, payload: bytes = b"", where: _Where = _Where.SEPARATE) -> None:
    """One message as the torch transport frames it; a payload, if any, inline behind the frame."""
    frame = torch.cat([header.to_tensor(), torch.tensor([int(where)], dtype=torch.int64)])
    if payload:
        frame = torch.cat([frame.view(torch.uint8), torch.frombuffer(bytearray(payload), dtype=torch.uint8)])
    group.isend(frame, TAG_MSG).wait(5)


def _reply(group: PairGroup, timeout_s: float) -> tuple[MsgKind, str]:
    op = group.irecv(torch.empty(HEADER_LEN, dtype=torch.int64), TAG_REPLY)
    op.wait(timeout_s)
    _, kind, _, _, nbytes = op.tensor.tolist()
    reason = group.irecv(torch.empty(nbytes, dtype=torch.uint8), TAG_REPLY) if nbytes else None
    if reason is not None:
        reason.wait(timeout_s)
    return MsgKind(kind), reason.tensor.numpy().tobytes().decode() if reason is not None else ""


def test_frame_headers_naming_huge_payloads_are_refused_before_anything_is_allocated(rendezvous):
    """Headers saying 2^40 or 2^34 bytes follow (a LAYER of a transfer never begun, a LAYER of a refused
    transfer, a BEGIN, an ABORT): each link is closed with a BYE naming the size, before a buffer is posted
    (the process's peak virtual memory does not grow by the 16 GiB a 2^34-byte buffer would take). A
    transfer the receiver expects meanwhile from its real sender is unaffected and lands bit for bit."""
    p = make_pair("torch", rendezvous.port)
    try:
        src, dst = start(p, "pending", 5, timeout_s=30)  # begun by the real sender, no layer sent yet
        peak = _vm_peak()
        desc = TransferDescriptor.for_spec("pending", p.rx.cache.spec, tuple(dst))
        for i, nbytes in enumerate((1 << 40, 1 << 34)):
            for case, header in (("layer-never-begun", Header(MsgKind.LAYER, 7, 0, nbytes)),
                                 ("begin", Header(MsgKind.BEGIN, 1, 0, nbytes)),
                                 ("abort", Header(MsgKind.ABORT, 1, 0, nbytes)),
                                 ("layer-of-refused", Header(MsgKind.LAYER, 1, 0, nbytes))):
                group, timeout_s = _rogue_link(p, rendezvous.port, f"rogue-{case}-{i}")
                try:
                    if case == "layer-of-refused":  # a BEGIN for a transfer expected from another sender
                        raw = desc.to_bytes()
                        _send(group, Header(MsgKind.BEGIN, 1, 0, len(raw)), raw, _Where.INLINE)
                        assert _reply(group, timeout_s)[0] == MsgKind.NACK
                    _send(group, header)
                    kind, reason = _reply(group, timeout_s)
                    assert kind == MsgKind.BYE and str(nbytes) in reason, (case, kind, reason)
                finally:
                    group.close()
        assert _vm_peak() - peak < _GiB, f"peak virtual memory grew by {(_vm_peak() - peak) / _GiB:.1f} GiB"
        for layer in range(SPEC.num_layers):
            p.sender.send_layer("pending", layer)
        rx, tx = p.receiver.wait("pending", 10), p.sender.wait("pending", 10)
        assert rx.ok and tx.ok, (rx.error, tx.error)
        assert landed(p, src, dst)
    finally:
        p.sender.close()
        p.receiver.close()


def _socket_inodes() -> set[str]:
    """The inodes of the sockets this process holds a descriptor to."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _tcp_rows() -> list[tuple[int, str, str]]:
    """(local port, state, inode) of every TCP socket in this network namespace."""
    rows = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                rows.append((int(cols[1].rsplit(":", 1)[1], 16), cols[3], cols[9]))
    return rows


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on."""
    mine = _socket_inodes()
    return {port for port, state, inode in _tcp_rows() if state == "0A" and inode in mine}


def _held_on(ports: set[int]) -> set[str]:
    """The connected sockets this process holds whose local port is one of `ports`: the connections its
    listeners accepted (a stray's own end has an ephemeral local port, so it never counts)."""
    mine = _socket_inodes()
    return {inode for port, state, inode in _tcp_rows() if port in ports and state != "0A" and inode in mine}


def test_a_thousand_stray_connections_to_a_links_listeners_leave_no_descriptor_behind(rendezvous):
    """Once a link is up, its gloo listeners (the sender's and the receiver's, both in this process) take
    no more connections: 500 strays to each are never accepted, and once they are gone this process holds
    exactly the connections on those ports it held before. (Counted by socket, not by descriptor: the
    process's other threads open and close descriptors of their own meanwhile.) The link keeps carrying
    transfers, before and after."""
    before = _listening_ports()
    p = make_pair("torch", rendezvous.port)
    try:
        transfer_lands(p, p.sender, "first", 3, 10)  # the link is up
        listeners = _listening_ports() - before
        assert len(listeners) == 2, listeners  # one gloo device per side
        baseline = _held_on(listeners)  # the link's own accepted connections
        strays = []
        for port in sorted(listeners):
            for _ in range(500):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex((HOST, port))
                strays.append(s)
        time.sleep(1.0)  # long enough for the kernel to complete any handshake gloo would accept
        accepted = _held_on(listeners) - baseline
        for s in strays:
            s.close()
        time.sleep(0.5)
        assert not accepted, f"{len(accepted)} stray connections were accepted"
        assert _held_on(listeners) == baseline
        transfer_lands(p, p.sender, "after-strays", 3, 10)
        assert _listening_ports() - before == listeners  # the same link, still up
    finally:
        p.sender.close()
        p.receiver.close()
