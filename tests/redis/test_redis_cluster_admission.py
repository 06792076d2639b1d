"""Admission bounds on a Redis Cluster, where the waiting requests are counted in every partition (each partition's
own count exactly, in the creating script; the others' read just before it): support/redis_cluster.py's cluster."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from shared.state.context_store import ContextStore, WaitingBounds, WaitingFull
from shared.redis_io.redis_client import async_client
from shared.settings import CommonSettings
from tests.support.factories import request_received


def _settings(cluster) -> CommonSettings:
    return CommonSettings(redis_url=cluster.url, redis_cluster=True, namespace=f"t{uuid.uuid4().hex[:8]}")


async def _create(store: ContextStore, owner: str, bounds: WaitingBounds) -> str:
    """The request's partition once created, else which bound refused it."""
    ev = request_received()
    try:
        await store.acreate(ev.request_id, {"priority": 0, "owner": owner}, {"prompt": ev.prompt}, ev, bounds)
    except WaitingFull as e:
        return e.which
    return f"p{store.names.partition(ev.request_id)}"


def _zcard_calls(cluster) -> int:
    return sum(int(n.info("commandstats").get("cmdstat_zcard", {}).get("calls", 0)) for n in cluster.nodes if n.alive)


def test_waiting_bounds_count_the_requests_of_every_partition(redis_cluster):
    settings = _settings(redis_cluster)
    bounds = WaitingBounds(total=5, per_owner=3)

    async def run():
        client = async_client(settings)
        store = ContextStore(client, settings.names(), 60)
        got = [await _create(store, "a", bounds) for _ in range(4)]
        got += [await _create(store, "b", bounds) for _ in range(3)]
        await client.aclose()
        return got

    got = asyncio.run(run())
    assert got[3] == "key_overloaded" and got[6] == "overloaded"
    created = got[:3] + got[4:6]
    assert len(set(created)) > 1 and all(p.startswith("p") for p in created)  # spread over partitions


@pytest.mark.parametrize("burst", [40])
def test_a_burst_of_admissions_shares_one_read_of_the_other_partitions_counts(redis_cluster, burst):
    """Each admission needs the waiting counts of the 15 partitions other than its own; those arriving while a read
    is in flight take its answer instead of sending 15 more reads each."""
    settings = _settings(redis_cluster)
    partitions = settings.names().partitions

    async def run():
        client = async_client(settings)
        store = ContextStore(client, settings.names(), 60)
        await client.initialize()
        before = _zcard_calls(redis_cluster)
        got = await asyncio.gather(*(_create(store, "", WaitingBounds(total=10_000)) for _ in range(burst)))
        await client.aclose()
        return got, _zcard_calls(redis_cluster) - before

    got, zcards = asyncio.run(run())
    assert all(p.startswith("p") for p in got)
    # Each creating script counts its own partition (one ZCARD); a shared read takes one per partition. Before,
    # every admission read the 15 others: 40 + 600 here.
    assert zcards <= burst + 4 * partitions
