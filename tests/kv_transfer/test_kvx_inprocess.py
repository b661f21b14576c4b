"""The sender and receiver cores over a real transport, both ends in this process (fast, precise).

Each test runs over torch.distributed (a real gloo pair group) and over the Ray object store. Cross-process
behaviour (killed and paused peers, several workers) is in test_kvx_processes.py.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest
import torch
from kvx_harness import HOST, make_config

from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (
    KVReceiver,
    KVSender,
    RendezvousServer,
    TransferStatus,
    create_receiver,
    create_sender,
    torch_links,
    torch_transport,
)

SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
NUM_BLOCKS = 64


@dataclass
class Side:
    cache: KVCache
    allocator: BlockAllocator
    transport: KVSender | KVReceiver


@dataclass
class Pair:
    tx: Side
    rx: Side
    sender: KVSender
    receiver: KVReceiver


_counter = iter(range(10**6))


def make_pair(transport: str, port: int | None, rx_spec: KVCacheSpec = SPEC) -> Pair:
    n = next(_counter)
    cfg = make_config(transport, port)
    tx_cache, rx_cache = KVCache(SPEC, NUM_BLOCKS), KVCache(rx_spec, NUM_BLOCKS)
    tx_cache.tensor.view(torch.uint8).copy_(torch.randint(0, 256, tx_cache.tensor.view(torch.uint8).shape,
                                                          dtype=torch.uint8))
    sender = create_sender(cfg, f"prefill-{n}", tx_cache, HOST)
    receiver = create_receiver(cfg, f"decode-{n}", rx_cache, HOST)
    rx_alloc = BlockAllocator(NUM_BLOCKS, enable_caching=False)
    ids = rx_alloc.allocate(NUM_BLOCKS)
    random.Random(n).shuffle(ids)
    rx_alloc.free(ids)  # reserved ids come out scattered
    return Pair(Side(tx_cache, BlockAllocator(NUM_BLOCKS, enable_caching=False), sender),
                Side(rx_cache, rx_alloc, receiver), sender, receiver)


@pytest.fixture(params=["torch", "ray"])
def pair(request, rendezvous):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    p = make_pair(request.param, rendezvous.port)
    yield p
    p.sender.close()
    p.receiver.close()


def start(p: Pair, rid: str, n: int, timeout_s: float = 10.0, tx_timeout_s: float | None = None):
    src, dst = p.tx.allocator.allocate(n), p.rx.allocator.allocate(n)
    assert src is not None and dst is not None
    p.receiver.expect(rid, p.sender.endpoint_id, dst, time.monotonic() + timeout_s)
    p.sender.begin(rid, p.receiver.address, src, dst, time.monotonic() + (tx_timeout_s or timeout_s))
    return src, dst


def landed(p: Pair, src: list[int], dst: list[int]) -> bool:
    return torch.equal(p.tx.cache.tensor[:, :, src].view(torch.uint8), p.rx.cache.tensor[:, :, dst].view(torch.uint8))


def accept_queue(p: Pair, port: int):
    """(config, a store client, the receiver's accept-queue key): for tests that write to the queue."""
    from kv_transfer.rendezvous import accept_queue_key, connect_store

    cfg = make_config("torch", port)
    address = p.receiver.address
    return (cfg, connect_store(HOST, port, cfg.connect_timeout_s),
            accept_queue_key(cfg.namespace, address.endpoint_id, address.incarnation))


def push_and_drain(store, queue: str, entries, caplog) -> list[str]:
    """Push `entries` onto the accept queue, wait until the listener has popped them all, and return the
    messages of the entries it dropped."""
    import logging

    with caplog.at_level(logging.WARNING, logger=torch_transport.__name__):
        caplog.clear()
        for entry in entries:
            store.queue_push(queue, entry)
        deadline = time.monotonic() + 10
        while store.queue_len(queue) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.queue_len(queue) == 0, "the listener stopped draining its queue"
        time.sleep(0.1)  # the last pop is logged just after the queue empties
    return [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]


def transfer_lands(p: Pair, sender: KVSender, rid: str, n: int, timeout_s: float) -> None:
    """A full transfer of `n` blocks from `sender` to the pair's receiver, checked bit for bit."""
    src, dst = p.tx.allocator.allocate(n), p.rx.allocator.allocate(n)
    assert src is not None and dst is not None
    p.receiver.expect(rid, sender.endpoint_id, dst, time.monotonic() + timeout_s)
    sender.begin(rid, p.receiver.address, src, dst, time.monotonic() + timeout_s)
    for layer in range(SPEC.num_layers):
        sender.send_layer(rid, layer)
    rx, tx = p.receiver.wait(rid, timeout_s), sender.wait(rid, timeout_s)
    assert rx.ok and tx.ok, (rx.error, tx.error)
    assert landed(p, src, dst)


def test_interleaved_transfers_on_one_link_all_land(pair):
    rng = random.Random(0)
    jobs = {f"r{i}": start(pair, f"r{i}", rng.randint(1, 6)) for i in range(10)}
    pending = [(rid, layer) for rid in jobs for layer in range(SPEC.num_layers)]
    rng.shuffle(pending)
    pending.sort(key=lambda x: x[1])  # layers of one request in order, requests interleaved at random
    for rid, layer in pending:
        pair.sender.send_layer(rid, layer)
    for rid, (src, dst) in jobs.items():
        rx, tx = pair.receiver.wait(rid, 10), pair.sender.wait(rid, 10)
        assert rx.ok and tx.ok, (rx.error, tx.error)
        assert rx.block_ids == tuple(dst) and tx.block_ids == tuple(src)
        assert landed(pair, src, dst)
    assert sorted(set(b for _, d in jobs.values() for b in d)) != list(range(len(jobs)))


def test_layout_mismatch_fails_both_sides_naming_the_field(rendezvous):
    p = make_pair("torch", rendezvous.port, KVCacheSpec(4, 2, 8, 8, torch.bfloat16))  # block_size 8 vs 4
    try:
        start(p, "m", 3)
        for layer in range(SPEC.num_layers):
            p.sender.send_layer("m", layer)
        rx, tx = p.receiver.wait("m", 10), p.sender.wait("m", 10)
        assert not rx.ok and "block_size" in rx.error and "sender has 4, receiver has 8" in rx.error
        assert not tx.ok and "block_size" in tx.error
        assert not p.rx.cache.tensor.any(), "a refused transfer wrote into the cache"
    finally:
        p.sender.close()
        p.receiver.close()


def test_stalled_sender_fails_both_sides_at_the_deadline_and_late_layers_are_dropped(pair):
    rx_free, tx_free = pair.rx.allocator.num_free_blocks, pair.tx.allocator.num_free_blocks
    t0 = time.monotonic()
    src, dst = start(pair, "s", 3, timeout_s=0.8, tx_timeout_s=30.0)
    pair.sender.send_layer("s", 0)
    rx = pair.receiver.wait("s", 10)
    assert not rx.ok and "deadline passed with 1/4 layers landed" in rx.error
    assert 0.8 <= time.monotonic() - t0 < 1.5
    pair.rx.allocator.free(list(rx.block_ids))
    snapshot = pair.rx.cache.tensor.view(torch.uint8).clone()
    for layer in range(1, SPEC.num_layers):  # the prefill resumes: too late
        pair.sender.send_layer("s", layer)
    tx = pair.sender.wait("s", 10)  # the receiver's NACK reaches the sender
    assert not tx.ok and "deadline passed" in tx.error, tx.error
    assert torch.equal(snapshot, pair.rx.cache.tensor.view(torch.uint8)), "a layer landed after its transfer failed"
    pair.tx.allocator.free(list(tx.block_ids))
    assert (pair.rx.allocator.num_free_blocks, pair.tx.allocator.num_free_blocks) == (rx_free, tx_free)


def test_deadlines_extended_while_progress_is_made_outlive_their_first_value(pair):
    """A lease: both deadlines are pushed on as layers come (the sender) and as the router renews (the
    receiver), so a transfer slower than its first deadline lands; once renewals stop, it fails."""
    src, dst = start(pair, "slow", 3, timeout_s=0.6)
    for layer in range(SPEC.num_layers):
        time.sleep(0.3)  # 4 x 0.3 s: well past the first 0.6 s deadline
        until = time.monotonic() + 0.6
        assert pair.receiver.extend("slow", until) and pair.sender.extend("slow", until)
        pair.sender.send_layer("slow", layer)
    rx, tx = pair.receiver.wait("slow", 10), pair.sender.wait("slow", 10)
    assert rx.ok and tx.ok, (rx.error, tx.error)
    assert landed(pair, src, dst)
    assert not pair.receiver.extend("slow", time.monotonic() + 5)  # finished: nothing to extend

    start(pair, "lapsed", 2, timeout_s=0.4, tx_timeout_s=30.0)
    rx = pair.receiver.wait("lapsed", 10)  # no renewal, no layer: the lease lapses
    assert not rx.ok and "deadline passed with 0/4 layers landed" in rx.error


def test_unexpected_request_and_wrong_sender_are_refused(pair):
    src = pair.tx.allocator.allocate(2)
    pair.sender.begin("nobody-expects", pair.receiver.address, src, [1, 2], time.monotonic() + 10)
    tx = pair.sender.wait("nobody-expects", 10)
    assert not tx.ok and "expects no transfer 'nobody-expects'" in tx.error
    pair.receiver.expect("other", "prefill-elsewhere", [3, 4], time.monotonic() + 10)
    pair.sender.begin("other", pair.receiver.address, src, [3, 4], time.monotonic() + 10)
    tx = pair.sender.wait("other", 10)
    assert not tx.ok and "expected from 'prefill-elsewhere'" in tx.error
    assert pair.receiver.poll("other") == TransferStatus.PENDING  # still waiting for its real sender
    pair.receiver.abort("other")
    assert not pair.receiver.wait("other", 1).ok


def test_abort_on_either_side_reaches_the_other(pair):
    start(pair, "a1", 2)
    pair.sender.send_layer("a1", 0)
    pair.receiver.abort("a1", "client cancelled")
    rx = pair.receiver.wait("a1", 1)
    assert not rx.ok and "client cancelled" in rx.error
    tx = pair.sender.wait("a1", 5)  # told at the next ping at the latest
    assert not tx.ok and "client cancelled" in tx.error

    start(pair, "a2", 2)
    pair.sender.send_layer("a2", 0)
    pair.sender.abort("a2", "prefill preempted")
    assert "prefill preempted" in pair.sender.wait("a2", 1).error
    rx = pair.receiver.wait("a2", 5)
    assert not rx.ok and "prefill preempted" in rx.error


def test_nothing_to_ship_finishes_at_once(pair):
    pair.receiver.expect("cached", pair.sender.endpoint_id, [], time.monotonic() + 10)
    pair.sender.begin("cached", pair.receiver.address, [], [], time.monotonic() + 10)
    pair.sender.send_layer("cached", 0)  # the model does not need to know
    assert pair.receiver.wait("cached", 0.1).ok and pair.sender.wait("cached", 0.1).ok


def test_api_misuse_is_a_clear_error(pair):
    start(pair, "dup", 1)
    with pytest.raises(ValueError, match="already in flight"):
        pair.receiver.expect("dup", pair.sender.endpoint_id, [5], time.monotonic() + 10)
    with pytest.raises(ValueError, match="already sent"):
        pair.sender.send_layer("dup", 0)
        pair.sender.send_layer("dup", 0)
    with pytest.raises(ValueError, match="outside"):
        pair.sender.send_layer("dup", SPEC.num_layers)
    with pytest.raises(ValueError, match="pair up"):
        pair.sender.begin("x", pair.receiver.address, [1, 2], [1], time.monotonic() + 10)
    with pytest.raises(ValueError, match="outside the cache"):
        pair.receiver.expect("y", "s", [NUM_BLOCKS], time.monotonic() + 10)
    with pytest.raises(ValueError, match="repeat"):
        pair.receiver.expect("y", "s", [3, 3], time.monotonic() + 10)
    with pytest.raises(KeyError):
        pair.sender.send_layer("never-begun", 0)
    with pytest.raises(TimeoutError):
        pair.receiver.wait("dup", 0.05)
    for layer in range(1, SPEC.num_layers):
        pair.sender.send_layer("dup", layer)
    assert pair.receiver.wait("dup", 10).ok
    with pytest.raises(KeyError):
        pair.receiver.poll("dup")  # collected


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_closing_the_receiver_fails_what_is_in_flight(pair):
    start(pair, "c", 2)
    pair.sender.send_layer("c", 0)
    wait_for(lambda: pair.receiver.poll("c") == TransferStatus.TRANSFERRING, 10)
    pair.receiver.close()
    rx = pair.receiver.wait("c", 1)
    assert not rx.ok and "receiver closed" in rx.error
    assert not pair.sender.wait("c", 5).ok


def test_a_receiver_that_never_shows_up_fails_the_transfer_by_its_deadline(pair):
    from protocol.messages import PeerAddress

    ghost = PeerAddress(pair.receiver.address.transport, "ghost", "0", "cpu", inbox=pair.receiver.address.inbox)
    src = pair.tx.allocator.allocate(2)
    t0 = time.monotonic()
    pair.sender.begin("g", ghost, src, [1, 2], time.monotonic() + 0.6)
    for layer in range(SPEC.num_layers):
        pair.sender.send_layer("g", layer)
    bound = make_config("ray", None)
    tx = pair.sender.wait("g", bound.liveness_s + bound.op_timeout_s + 5)
    assert not tx.ok
    if pair.receiver.address.transport == "torch":  # no link ever forms: the layers never leave
        assert "deadline passed" in tx.error and time.monotonic() - t0 < 1.2, tx.error
    else:  # they leave, into an inbox nobody reads: the sender waits for a verdict until the link breaks
        cfg = make_config("ray", None)
        assert "deadline passed" in tx.error or "silent" in tx.error, tx.error
        assert time.monotonic() - t0 < 0.6 + cfg.liveness_s + cfg.op_timeout_s + 0.6


def test_each_layer_lands_before_the_next_is_offered(pair):
    """Layer-wise push: a layer is shipped the moment it is offered, not when the request is complete."""
    src, dst = start(pair, "lw", 3)
    rx_layer = lambda layer: pair.rx.cache.tensor[layer, :, dst].view(torch.uint8)  # noqa: E731
    tx_layer = lambda layer: pair.tx.cache.tensor[layer, :, src].view(torch.uint8)  # noqa: E731
    for layer in range(SPEC.num_layers):
        pair.sender.send_layer("lw", layer)
        wait_for(lambda layer=layer: torch.equal(rx_layer(layer), tx_layer(layer)), 10)
        if layer + 1 < SPEC.num_layers:
            assert not rx_layer(layer + 1).any(), "a layer landed before it was offered"
            assert pair.receiver.poll("lw") == TransferStatus.TRANSFERRING
    assert pair.receiver.wait("lw", 10).ok and pair.sender.wait("lw", 10).ok


def test_links_leave_no_keys_in_the_rendezvous_store():
    """A link's rendezvous keys go with the link, so the router's store does not grow with links made."""
    server = RendezvousServer(HOST)  # its own store: other tests' links would be counted too
    try:
        p = make_pair("torch", server.port)
        for i in range(2):
            src, dst = start(p, f"k{i}", 3)
            for layer in range(SPEC.num_layers):
                p.sender.send_layer(f"k{i}", layer)
            assert p.receiver.wait(f"k{i}", 10).ok and p.sender.wait(f"k{i}", 10).ok
            assert landed(p, src, dst)
            assert server.num_keys() <= 2  # the live link's two rendezvous keys, at most
        p.sender.close()
        p.receiver.close()
        assert server.num_keys() == 0
    finally:
        server.close()


def test_layers_larger_than_a_receive_slot_travel_as_their_own_message(rendezvous, monkeypatch):
    """Over gloo a message that fits a receive slot travels whole; a larger layer follows its frame as a
    second message. Slots shrunk to 1 KiB here, so layers (2 KiB each at 8 blocks) take that path, while
    BEGIN and the small one-block transfer still fit."""
    monkeypatch.setattr(torch_links, "_SLOT_BYTES", 1024)
    p = make_pair("torch", rendezvous.port)
    try:
        for rid, n in (("big", 8), ("small", 1), ("big-again", 8)):
            src, dst = start(p, rid, n)
            for layer in range(SPEC.num_layers):
                p.sender.send_layer(rid, layer)
            rx, tx = p.receiver.wait(rid, 10), p.sender.wait(rid, 10)
            assert rx.ok and tx.ok, (rx.error, tx.error)
            assert landed(p, src, dst)
    finally:
        p.sender.close()
        p.receiver.close()


def test_a_sender_of_another_wire_protocol_is_told_why_and_nothing_crashes(rendezvous):
    """A sender of another protocol version (a rolling upgrade) opens a link and pings: the receiver
    answers BYE naming the version mismatch, and keeps serving senders of its own version."""
    from kv_transfer.pair_group import RECEIVER_RANK, SENDER_RANK, TAG_MSG, TAG_REPLY, PairGroup
    from kv_transfer.rendezvous import LinkRequest, link_prefix
    from kv_transfer.wire import HEADER_LEN, PROTOCOL_VERSION, MsgKind

    p = make_pair("torch", rendezvous.port)
    try:
        cfg, store, queue = accept_queue(p, rendezvous.port)
        request = LinkRequest.signed("time-traveller", "old-link-1", "cpu", queue, cfg.secret)
        store.queue_push(queue, request.to_json())
        group = PairGroup(store, link_prefix(cfg.namespace, request.link_id), SENDER_RANK, HOST,
                          cfg.connect_timeout_s, None)
        assert group.peer == RECEIVER_RANK
        ping = torch.tensor([PROTOCOL_VERSION + 1, int(MsgKind.PING), 0, 0, 0], dtype=torch.int64)
        group.isend(ping, TAG_MSG).wait(cfg.op_timeout_s)
        reply = group.irecv(torch.empty(HEADER_LEN, dtype=torch.int64), TAG_REPLY)
        reply.wait(cfg.op_timeout_s)
        version, kind, _, _, nbytes = reply.tensor.tolist()
        assert (version, kind) == (PROTOCOL_VERSION, int(MsgKind.BYE)) and nbytes > 0
        reason = group.irecv(torch.empty(nbytes, dtype=torch.uint8), TAG_REPLY)
        reason.wait(cfg.op_timeout_s)
        assert f"protocol {PROTOCOL_VERSION + 1}" in reason.tensor.numpy().tobytes().decode()
        group.close()

        src, dst = start(p, "after", 2)  # the receiver still serves its own kind
        for layer in range(SPEC.num_layers):
            p.sender.send_layer("after", layer)
        assert p.receiver.wait("after", 10).ok and p.sender.wait("after", 10).ok
        assert landed(p, src, dst)
    finally:
        p.sender.close()
        p.receiver.close()


def test_garbage_on_the_accept_queue_is_dropped_and_links_still_form(rendezvous, caplog):
    """Anything can reach the store, so the receiver's accept queue may hold junk: not JSON, the wrong
    shape, huge blobs, a stray close sentinel. Each is logged and dropped; the listener lives on, and the
    next real link request (a fresh sender's, after the junk) still forms a link that lands bit-exact."""
    import json

    from kv_transfer.rendezvous import MAX_LINK_REQUEST_BYTES

    good = {"sender": "s", "link_id": "abc", "device": "cpu"}
    garbage: list[bytes | str] = [
        b"", b"not json", b"\xff\xfe\xfd\x00", b"[1, 2, 3]", b"null", b'"a string"', b"{", b"[" * 100_000,
        json.dumps({"sender": "s"}), json.dumps({**good, "extra": 1}), json.dumps({**good, "sender": 7}),
        json.dumps({**good, "link_id": ""}), json.dumps({**good, "link_id": "../../evil"}),
        json.dumps({**good, "device": "tpu"}), json.dumps({**good, "sender": "x" * 1000}),
        json.dumps({**good, "sender": None}), json.dumps({**good, "device": ["cpu"]}),
        torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        .numpy().tobytes(),
        b"x" * (MAX_LINK_REQUEST_BYTES + 1),
        b"close",  # not from the receiver's own close(): must not stop the listener
    ]
    p = make_pair("torch", rendezvous.port)
    extra = None
    try:
        cfg, store, queue = accept_queue(p, rendezvous.port)

        def push_garbage_and_drain() -> None:
            dropped = push_and_drain(store, queue, garbage, caplog)
            assert len(dropped) == len(garbage), [r.getMessage() for r in caplog.records]
            assert all(len(m) < 500 for m in dropped), "a junk entry flooded the log"

        push_garbage_and_drain()
        transfer_lands(p, p.sender, "after-garbage", 5, 10)  # the sender's first link: formed after the junk
        push_garbage_and_drain()
        extra = create_sender(cfg, "prefill-late", p.tx.cache, HOST)
        transfer_lands(p, extra, "fresh-sender", 3, 10)  # a new link from a new sender, after more junk
    finally:
        if extra is not None:
            extra.close()
        p.sender.close()
        p.receiver.close()


def test_forged_and_replayed_link_requests_are_refused_and_real_transfers_still_land(rendezvous, caplog):
    """Well-formed link requests that are not the deployment's: signed with another secret, stale, meant
    for another receiver, unsigned, or a replay of a link id already accepted. Each is dropped and logged;
    the listener lives on and a real transfer right after lands bit for bit."""
    import dataclasses

    from kv_transfer.rendezvous import MAX_REQUEST_AGE_S, LinkRequest, accept_queue_key

    p = make_pair("torch", rendezvous.port)
    try:
        cfg, store, queue = accept_queue(p, rendezvous.port)
        other_queue = accept_queue_key(cfg.namespace, p.receiver.address.endpoint_id, "another-incarnation")
        # a genuine request, signed 3 minutes ago
        stale = LinkRequest.signed("mallory", "stale-1", "cpu", queue, cfg.secret,
                                   now=time.time() - MAX_REQUEST_AGE_S - 60)
        replayed = LinkRequest.signed("mallory", "replayed-1", "cpu", queue, cfg.secret)
        forged = [
            LinkRequest.signed("mallory", "wrong-secret", "cpu", queue, "not-the-secret"),
            LinkRequest.signed("mallory", "unsigned", "cpu", queue, None),
            LinkRequest.signed("mallory", "elsewhere", "cpu", other_queue, cfg.secret),
            dataclasses.replace(LinkRequest.signed(p.sender.endpoint_id, "tampered", "cpu", queue, cfg.secret),
                                sender="prefill-impostor"),
            stale,
            replayed,  # accepted once (its link never forms: nobody is behind it) ...
            replayed,  # ... and refused the second time
        ]
        dropped = push_and_drain(store, queue, [req.to_json() for req in forged], caplog)
        assert len(dropped) == len(forged) - 1, dropped
        for why in ("wrong MAC", "old", "replay"):
            assert any(why in m for m in dropped), (why, dropped)
        transfer_lands(p, p.sender, "real", 4, 15)
    finally:
        p.sender.close()
        p.receiver.close()
