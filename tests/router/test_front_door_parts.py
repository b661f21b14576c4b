"""The front door's parts on their own (no Ray, no model): the key file and its reload, the tenants' quotas,
the defensive JSON parsing of the HTTP door, cache salts in the block hashes, and the stalled-stream watch."""

from __future__ import annotations

import asyncio
import json
import re
import time
from types import SimpleNamespace

import pytest

from protocol.block_hash import hash_blocks, salt_root
from router.door import REPEAT_REFUSAL_DELAY_S, Door
from router.openai_request import ApiError, parse_body
from router.quotas import QuotaExceeded, QuotaGate
from router.stall_watch import StallWatch
from router.tenants import KeyTable, Role, Tenant, TenantLimits, parse_key_file
from router.validation import Limits

DOC = {"tenants": {"acme": {"max_concurrent_requests": 2, "max_queued_prompt_tokens": 100,
                            "tokens_per_minute": 600, "priority": 3}},
       "keys": [{"key": "sk-acme-0001", "tenant": "acme"}, {"key": "sk-ops-00001", "tenant": "ops", "role": "admin"}]}


def test_the_key_file_names_tenants_roles_limits_and_salts():
    table = parse_key_file(json.dumps(DOC))
    acme, ops = table["sk-acme-0001"], table["sk-ops-00001"]
    assert acme.role is Role.CLIENT and acme.limits.max_concurrent_requests == 2 and acme.limits.priority == 3
    assert acme.cache_salt == "acme" and ops.cache_salt == "ops"  # isolation is the default
    assert ops.is_admin and ops.limits == TenantLimits()


@pytest.mark.parametrize("doc, where", [
    ({"keys": []}, "keys"),
    ({"keys": [{"key": "short", "tenant": "a"}]}, "keys[0].key"),
    ({"keys": [{"key": "sk-00000001", "tenant": "a", "role": "root"}]}, "keys[0].role"),
    ({"keys": [{"key": "sk-00000001", "tenant": "a"}], "tenants": {"a": {"max_concurrent_requests": 0}}},
     "tenants.a.max_concurrent_requests"),
    ({"keys": [{"key": "sk-00000001", "tenant": "a"}], "tenants": {"a": {"burst": 1}}}, "tenants.a"),
])
def test_a_bad_key_file_is_refused_naming_the_entry(doc, where):
    with pytest.raises(ValueError, match="^" + re.escape(where)):
        parse_key_file(json.dumps(doc))


def test_lookup_takes_only_a_known_bearer_key_and_the_file_reloads(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps(DOC))
    now = [0.0]
    table = KeyTable.from_file(path, clock=lambda: now[0])
    assert table.lookup("Bearer sk-acme-0001").name == "acme"
    for bad in ("sk-acme-0001", "Bearer sk-acme-0002", "", "Bearer ", "Basic sk-acme-0001"):
        assert table.lookup(bad) is None
    table.add("sk-single-key", Tenant("default", Role.ADMIN))
    path.write_text("keys: [{key: sk-new-00001, tenant: new}]\n")
    now[0] += 2
    assert table.lookup("Bearer sk-new-00001").name == "new"
    assert table.lookup("Bearer sk-acme-0001") is None
    assert table.lookup("Bearer sk-single-key").is_admin  # --api-key survives reloads
    path.write_text("keys: [oops")  # a broken file keeps the keys in force
    now[0] += 2
    assert table.lookup("Bearer sk-new-00001").name == "new"


def test_quotas_refuse_naming_the_limit_and_give_back_on_release():
    now = [0.0]
    gate = QuotaGate(clock=lambda: now[0])
    acme = parse_key_file(json.dumps(DOC))["sk-acme-0001"]
    a = gate.admit(acme, 60)
    with pytest.raises(QuotaExceeded) as e:
        gate.admit(acme, 60)
    assert e.value.limit == "max_queued_prompt_tokens"
    a.first_token()  # prefilled: no longer queued
    b = gate.admit(acme, 60)
    with pytest.raises(QuotaExceeded) as e:
        gate.admit(acme, 1)
    assert e.value.limit == "max_concurrent_requests" and e.value.retry_after == 1
    a.release()
    b.release()
    b.release()  # idempotent
    assert gate.held(acme) == (0, 0)
    # tokens per minute: 600 - 120 spent; 500 more generated leaves -20
    c = gate.admit(acme, 10)
    c.generated(500)
    c.release()
    with pytest.raises(QuotaExceeded) as e:
        gate.admit(acme, 10)
    assert e.value.limit == "tokens_per_minute" and e.value.retry_after == 4  # 40 tokens at 10/s
    now[0] += 4.0
    gate.admit(acme, 10).release()


def test_a_tenant_back_before_its_retry_after_is_refused_a_little_later(monkeypatch):
    now = [0.0]
    gate = QuotaGate(clock=lambda: now[0])
    acme = parse_key_file(json.dumps(DOC))["sk-acme-0001"]
    door = Door(Limits(max_model_len=64, vocab_size=64), tokenizer=None, quotas=gate)  # type: ignore[arg-type]
    req = SimpleNamespace(num_prompt_tokens=10)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # the door's waits, recorded instead of timed
        waits.append(seconds)

    monkeypatch.setattr("router.door.asyncio.sleep", sleep)
    held = [asyncio.run(door.admit(acme, req)) for _ in range(2)]  # its 2 concurrent requests

    def refused() -> tuple[bool, list[float]]:
        waits.clear()
        with pytest.raises(QuotaExceeded) as e:
            asyncio.run(door.admit(acme, req))
        return e.value.ignored_retry_after, list(waits)

    assert refused() == (False, [])  # the first refusal: at once
    now[0] += 0.5  # back before the retry-after (1 s) has passed
    assert refused() == (True, [REPEAT_REFUSAL_DELAY_S])
    now[0] += 1.0  # a client that waited out the latest retry-after is answered at once
    assert refused() == (False, [])
    for t in held:
        t.release()
    asyncio.run(door.admit(acme, req)).release()
    assert waits == []


@pytest.mark.parametrize("raw, param", [
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", None),  # kept as HugeInteger: the field's check names it
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\udfff x"}]}', "messages"),
    (b'{"stop": ' + b"[" * 40 + b"]" * 40 + b"}", "stop"),
    (b"[" * 100000 + b"]" * 100000, None),
    (b"\xff\xfe", None),
])
def test_hostile_json_is_an_api_error_never_a_crash(raw, param):
    try:
        body = parse_body(raw)
    except ApiError as e:
        assert e.status == 400 and e.param == param
        return
    assert repr(body["max_tokens"]) == "an integer of 5000 digits"


def test_a_cache_salt_gives_a_prompt_a_hash_chain_of_its_own():
    tokens = list(range(64))
    plain, a, b = (hash_blocks(tokens, 16, parent=salt_root(s)) for s in ("", "alice", "bob"))
    assert plain == hash_blocks(tokens, 16)  # no salt: the hashes every worker already has
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert hash_blocks(tokens, 16, parent=salt_root("alice")) == a  # deterministic across processes


def test_the_stall_watch_cancels_a_blocked_hand_over_and_closes_its_stream():
    async def main():
        stalled = []
        watch = StallWatch(0.2, on_stalled=stalled.append)
        closed = asyncio.Event()

        async def chunks():
            try:
                while True:
                    yield 1
            finally:
                closed.set()

        async def writer(block_s: float):
            gen = chunks()
            h = watch.watch(gen, "grpc")
            async for _ in gen:
                h.blocked_since = time.monotonic()
                await asyncio.sleep(block_s)  # the client's window is full this long
                h.blocked_since = None
                if block_s < 0.2:
                    break
            watch.forget(h)
            await gen.aclose()

        moving = asyncio.ensure_future(writer(0.05))
        stuck = asyncio.ensure_future(writer(10.0))
        await moving
        with pytest.raises(asyncio.CancelledError):
            await stuck
        await asyncio.wait_for(closed.wait(), 2)
        assert stalled == ["grpc"] and watch.num_watched == 0
        await watch.close()

    asyncio.run(main())


def test_the_admission_queue_serves_higher_classes_first_and_sheds_the_lowest():
    from router.admission import Admission
    from router.config import RouterConfig
    from router.observer import RequestObserver
    from router.registry import WorkerRegistry
    from router.shared import RouterError, Shared

    async def main():
        admission = Admission(Shared(RouterConfig(max_queue=2), WorkerRegistry(), RequestObserver()))
        order: list[str] = []

        async def wait(name: str, priority: int):
            try:
                await admission.queue.wait_for_room(1, time.time() + 10, priority)
                order.append(name)
            except RouterError as e:
                order.append(f"{name}: {e.code}")

        low_a = asyncio.ensure_future(wait("low-a", 0))
        high = asyncio.ensure_future(wait("high", 5))
        await asyncio.sleep(0.05)
        # the queue is full (2): a class-9 request sheds the newest of the lowest class, low-a
        top = asyncio.ensure_future(wait("top", 9))
        await asyncio.sleep(0.05)
        assert order == ["low-a: RESOURCE_EXHAUSTED"]
        # a class-0 request finds the queue full of higher classes: refused at once
        await wait("low-b", 0)
        assert order[-1] == "low-b: RESOURCE_EXHAUSTED"
        admission.shared.room.set()  # room: the highest class goes first, then the next
        await asyncio.gather(low_a, high, top)
        assert order[2:] == ["top", "high"]

    asyncio.run(main())
