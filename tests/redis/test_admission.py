"""Admission under concurrency (issue 12): requests arriving together are admitted together, the waiting bound
stays exact across gateways, and a burst shares one readiness check; a request soon after a positive check does not
wait for the next (issue 29). Redis answers through a client that delays
every script call, so concurrent admissions overlap deterministically."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.gateway.session import admission
from services.gateway.session.core import GatewayCore
from services.gateway.edge.errors import Overloaded, Unavailable
from shared.process.runtime import Liveness
from shared.settings import GatewaySettings
from tests.support.inproc import TTL_S, calls, mark_live, small

SCRIPT_DELAY_S = 0.05  # long next to a local round trip: admissions that can overlap do


class SlowScripts(aioredis.Redis):
    """Delays every EVALSHA, counting how many are in flight at once."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.in_flight = self.most_in_flight = 0

    async def execute_command(self, *args, **options):
        if args[0] != "EVALSHA":
            return await super().execute_command(*args, **options)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(SCRIPT_DELAY_S)
            return await super().execute_command(*args, **options)
        finally:
            self.in_flight -= 1


def slow_core(redis_url: str, names, **settings) -> GatewayCore:
    s = GatewaySettings(redis_url=redis_url, namespace=names.ns, **settings)
    return GatewayCore(s, SlowScripts.from_url(redis_url), None, "test-model")


async def submit_all(cores: list[GatewayCore], n: int) -> list:
    """n requests at once, spread over the cores; each request id, or the Overloaded it got."""

    async def one(i: int):
        try:
            return (await cores[i % len(cores)].submit(small(f"Hi {i}"), 2)).request_id
        except Overloaded as e:
            return e

    try:
        return await asyncio.gather(*[one(i) for i in range(n)])
    finally:
        for core in cores:
            await core.r.aclose()


def test_requests_arriving_together_are_created_together_not_one_at_a_time(redis_server, redis_client, names):
    mark_live(redis_client, names)

    async def run():
        core = slow_core(redis_server.url, names)
        out = await submit_all([core], 8)
        return out, core.r.most_in_flight

    out, most = asyncio.run(run())
    assert all(isinstance(rid, str) for rid in out)
    assert most == 8  # every creation in flight at once (one at a time before: a lock spanned its round trips)


def test_the_waiting_bound_is_exact_for_requests_arriving_together_at_two_gateways(redis_server, redis_client, names):
    mark_live(redis_client, names)

    async def run():
        cores = [slow_core(redis_server.url, names, max_waiting_requests=3) for _ in range(2)]
        return await submit_all(cores, 10)

    out = asyncio.run(run())
    assert sum(isinstance(x, str) for x in out) == 3
    assert all(x.code == "overloaded" for x in out if not isinstance(x, str))
    assert redis_client.zcard(names.waiting(0)) == 3


def test_a_burst_of_requests_shares_one_readiness_check(redis_server, redis_client, names):
    mark_live(redis_client, names)
    redis_client.config_resetstat()

    async def run():
        return await submit_all([slow_core(redis_server.url, names)], 20)

    assert all(isinstance(rid, str) for rid in asyncio.run(run()))
    assert calls(redis_client, "hgetall") == 3  # one check: the tokenizer, scheduler and worker liveness hashes


class LostFirstReply(aioredis.Redis):
    """The first EVALSHA runs on the server and its reply is lost: redis-py's retry sends it again, and that
    second run's answer is the one the caller gets."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.resent = False

    async def execute_command(self, *args, **options):
        if args[0] == "EVALSHA" and not self.resent:
            await super().execute_command(*args, **options)  # NOSCRIPT (not loaded yet) raises: no re-send then
            self.resent = True
        return await super().execute_command(*args, **options)


def test_a_creation_resent_after_its_reply_was_lost_is_the_same_request_not_an_error(redis_server, redis_client, names):
    mark_live(redis_client, names)

    async def run():
        s = GatewaySettings(redis_url=redis_server.url, namespace=names.ns)
        core = GatewayCore(s, LostFirstReply.from_url(redis_server.url), None, "test-model")
        try:
            return (await core.submit(small(), 2)).request_id, core.r.resent
        finally:
            await core.r.aclose()

    rid, resent = asyncio.run(run())
    assert resent and redis_client.zscore(names.waiting(0), rid) is not None
    assert redis_client.zcard(names.waiting(0)) == 1 and redis_client.xlen(names.received_stream(0)) == 1


class HeldLivenessReads(aioredis.Redis):
    """The readiness check's reads of the liveness hashes (HGETALL) wait while `held` is set; `reached` is set when
    one arrives."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.free, self.reached = asyncio.Event(), asyncio.Event()
        self.free.set()

    async def execute_command(self, *args, **options):
        if args[0] == "HGETALL":
            self.reached.set()
            await self.free.wait()
        return await super().execute_command(*args, **options)


def held_core(redis_url: str, names) -> GatewayCore:
    s = GatewaySettings(redis_url=redis_url, namespace=names.ns)
    return GatewayCore(s, HeldLivenessReads.from_url(redis_url), None, "test-model")


def test_a_request_soon_after_a_positive_readiness_check_does_not_wait_for_the_next(
    redis_server, redis_client, names, monkeypatch
):
    """A single stream's next request (a second after the last) is created while a fresh check runs beside it."""
    mark_live(redis_client, names)
    monkeypatch.setattr(admission, "READY_CACHE_S", 0.0)  # every check is past its cache at once

    async def run():
        core = held_core(redis_server.url, names)
        try:
            await core.submit(small("first"), 2)  # no check before it: it waits for one
            core.r.free.clear()
            rid = (await asyncio.wait_for(core.submit(small("second"), 2), 10)).request_id
            return rid, core.r.reached.is_set()
        finally:
            core.r.free.set()
            await core.r.aclose()

    rid, check_started = asyncio.run(run())
    assert check_started  # the fresh check was on its way, held, when the request was created
    assert redis_client.zscore(names.waiting(0), rid) is not None


def test_a_request_long_after_the_last_positive_check_waits_for_a_new_one(
    redis_server, redis_client, names, monkeypatch
):
    mark_live(redis_client, names)
    monkeypatch.setattr(admission, "READY_CACHE_S", 0.0)
    monkeypatch.setattr(admission, "READY_STALE_S", 0.0)

    async def run():
        core = held_core(redis_server.url, names)
        try:
            await core.submit(small("first"), 2)
            core.r.free.clear()
            core.r.reached.clear()
            second = asyncio.create_task(core.submit(small("second"), 2))
            await core.r.reached.wait()
            for _ in range(10):  # the loop runs everything else that is ready: the request cannot go on
                await asyncio.sleep(0)
            waited = not second.done()
            core.r.free.set()
            await second
            return waited
        finally:
            core.r.free.set()
            await core.r.aclose()

    assert asyncio.run(run())
    assert redis_client.zcard(names.waiting(0)) == 2


def test_a_check_beside_a_request_that_finds_a_service_gone_refuses_the_next(
    redis_server, redis_client, names, monkeypatch
):
    mark_live(redis_client, names)
    monkeypatch.setattr(admission, "READY_CACHE_S", 0.0)

    async def run():
        core = held_core(redis_server.url, names)
        try:
            await core.submit(small("first"), 2)
            Liveness(names, "worker", "worker-1", 1.0, TTL_S).clear(redis_client)
            await core.submit(small("second"), 2)  # admitted on the first check; a fresh one starts beside it
            await asyncio.gather(core.admission._checking, return_exceptions=True)  # that one's answer is in
            with pytest.raises(Unavailable) as refused:
                await core.submit(small("third"), 2)
            return refused.value
        finally:
            await core.r.aclose()

    refused = asyncio.run(run())
    assert refused.code == "not_ready" and "worker" in str(refused)
    assert redis_client.zcard(names.waiting(0)) == 2  # the third never created
