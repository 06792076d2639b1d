"""The bus recipe across processes: an event a killed consumer read and never acknowledged is claimed by another (the
rest of the recipe: tests/redis/test_bus.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from shared.wire.constants import GROUP_TOKENIZER
from tests.redis.test_bus import _bus
from tests.support.factories import request_received


def test_unacked_event_of_a_killed_consumer_is_claimed_by_another(redis_server, redis_client, names):
    bus = _bus(redis_client, names, "survivor")
    bus.ensure_group(names.received_stream(0), GROUP_TOKENIZER)
    ev = request_received()
    bus.publish(names.received_stream(0), ev)
    # A real process reads the event, then dies by SIGKILL before acknowledging it.
    script = textwrap.dedent(f"""
        import os, signal, redis
        from shared.wire.bus import Bus
        from shared.wire.constants import Names
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
