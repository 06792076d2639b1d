"""CONVEYOR_INSTANCE_ID: an id that would break the names built from it is refused at start, naming the setting,
and a gateway whose id a live gateway holds does not start (issue 24, item 15). Either made the scheduler read a
live gateway as gone and cancel its requests: a ':' or '{' moves the id out of its reply stream's hash tag, and
two gateways under one id share a reply stream and a liveness entry."""

from __future__ import annotations

import asyncio

import pytest

from shared.wire.errors import FatalError
from shared.process.liveness import read_live
from shared.process.runtime import Liveness
from tests.support.inproc import gateway_core

FAST = {"liveness_ttl_s": 1.0, "heartbeat_interval_s": 0.2}


def test_a_gateway_whose_id_a_live_gateway_holds_is_refused_at_start(redis_server, redis_client, names):
    async def run():
        first = gateway_core(redis_server.url, names, instance_id="gw-a", **FAST)
        await first.start()
        try:
            second = gateway_core(redis_server.url, names, instance_id="gw-a", **FAST)
            with pytest.raises(FatalError) as e:
                await second.start()
            await second.loop_r.aclose()
            assert "CONVEYOR_INSTANCE_ID" in str(e.value) and "'gw-a'" in str(e.value)
            assert first.id in read_live(redis_client, names, "gateway")
            assert not first.stalled_loops()
        finally:
            await first.stop()

    asyncio.run(run())


def test_a_gateway_restarted_under_its_id_after_a_crash_starts(redis_server, redis_client, names):
    """Its predecessor's entry, never refreshed again, is waited out (at most a TTL); then the id is its own."""
    Liveness(names, "gateway", "gw-a", FAST["heartbeat_interval_s"], FAST["liveness_ttl_s"]).refresh(redis_client)

    async def run():
        core = gateway_core(redis_server.url, names, instance_id="gw-a", **FAST)
        await core.start()
        try:
            assert "gw-a" in read_live(redis_client, names, "gateway")
        finally:
            await core.stop()

    asyncio.run(run())
