"""The bus recipe: groups, ack after effect, claim from dead consumers, dead-letter."""

from __future__ import annotations

import time

from shared.wire.bus import Bus
from shared.wire.constants import EVENT_FIELD, GROUP_TOKENIZER
from tests.support.factories import request_received


def _bus(client, names, consumer, **kw) -> Bus:
    return Bus(
        client,
        names,
        consumer,
        block_ms=50,
        claim_idle_ms=kw.pop("claim_idle_ms", 200),
        max_deliveries=kw.pop("max_deliveries", 3),
        **kw,
    )


def test_read_returns_each_new_event_once(redis_client, names):
    bus = _bus(redis_client, names, "a")
    bus.ensure_group(names.received_stream(0), GROUP_TOKENIZER)
    bus.ensure_group(names.received_stream(0), GROUP_TOKENIZER)  # idempotent
    sent = [request_received() for _ in range(3)]
    for ev in sent:
        bus.publish(names.received_stream(0), ev)
    got = bus.read([names.received_stream(0)], GROUP_TOKENIZER)
    assert [d.event for d in got] == sent
    assert bus.read([names.received_stream(0)], GROUP_TOKENIZER, block_ms=0) == []


def test_event_delivered_too_often_goes_to_dead_letter(redis_client, names):
    dead = []
    bus = _bus(
        redis_client,
        names,
        "a",
        claim_idle_ms=100,
        max_deliveries=2,
        on_dead=lambda stream, event, why: dead.append((stream, event, why)),
    )
    bus.ensure_group(names.received_stream(0), GROUP_TOKENIZER)
    ev = request_received()
    bus.publish(names.received_stream(0), ev)
    assert len(bus.read([names.received_stream(0)], GROUP_TOKENIZER)) == 1  # delivery 1, never acked
    deadline = time.monotonic() + 10
    while not dead and time.monotonic() < deadline:
        bus.sweep(names.received_stream(0), GROUP_TOKENIZER)  # delivery 2, then over the limit
        time.sleep(0.05)
    assert dead and dead[0][1] == ev
    entries = redis_client.xrange(names.dead_letter_stream)
    assert len(entries) == 1 and entries[0][1][b"stream"] == names.received_stream(0).encode()
    assert redis_client.xpending(names.received_stream(0), GROUP_TOKENIZER)["pending"] == 0


def test_undecodable_entry_is_dead_lettered_without_blocking_the_group(redis_client, names):
    bus = _bus(redis_client, names, "a")
    bus.ensure_group(names.received_stream(0), GROUP_TOKENIZER)
    redis_client.xadd(names.received_stream(0), {EVENT_FIELD: b"\xc1 not msgpack"})
    good = request_received()
    bus.publish(names.received_stream(0), good)
    got = bus.read([names.received_stream(0)], GROUP_TOKENIZER)
    assert [d.event for d in got] == [good]
    assert redis_client.xlen(names.dead_letter_stream) == 1
