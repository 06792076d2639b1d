"""The bus recipe: groups, ack after effect, claim from dead consumers, dead-letter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from shared.bus import Bus
from shared.constants import EVENT_FIELD, GROUP_TOKENIZER
from tests.factories import request_received


def _bus(client, names, consumer, **kw) -> Bus:
    return Bus(client, names, consumer, block_ms=50, claim_idle_ms=kw.pop("claim_idle_ms", 200),
               max_deliveries=kw.pop("max_deliveries", 3), **kw)


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


def test_unacked_event_of_a_killed_consumer_is_claimed_by_another(redis_server, redis_client, names):
    bus = _bus(redis_client, names, "survivor")
    bus.ensure_group(names.received_stream(0), GROUP_TOKENIZER)
    ev = request_received()
    bus.publish(names.received_stream(0), ev)
    # A real process reads the event, then dies by SIGKILL before acknowledging it.
    script = textwrap.dedent(f"""
        import os, signal, redis
        from shared.bus import Bus
        from shared.constants import Names
        bus = Bus(redis.Redis.from_url({redis_server.url!r}), Names({names.ns!r}), "doomed", 50, 200, 3)
        assert len(bus.read([Names({names.ns!r}).received_stream(0)], {GROUP_TOKENIZER!r})) == 1
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert bus.read([names.received_stream(0)], GROUP_TOKENIZER, block_ms=0) == []  # not new any more
    claimed = []
    deadline = time.monotonic() + 10
    while not claimed and time.monotonic() < deadline:
        claimed = bus.sweep(names.received_stream(0), GROUP_TOKENIZER)
        time.sleep(0.05)
    assert [d.event for d in claimed] == [ev]
    bus.ack_all([claimed[0]])
    assert redis_client.xpending(names.received_stream(0), GROUP_TOKENIZER)["pending"] == 0


def test_event_delivered_too_often_goes_to_dead_letter(redis_client, names):
    dead = []
    bus = _bus(redis_client, names, "a", claim_idle_ms=100, max_deliveries=2,
               on_dead=lambda stream, event, why: dead.append((stream, event, why)))
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
