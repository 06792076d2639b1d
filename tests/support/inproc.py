"""An in-process gateway core on a test's own Redis (no model, no service processes): for tests of admission,
listing and readiness that need the real gateway code and a real Redis but nothing downstream."""

from __future__ import annotations

import contextlib

import redis.asyncio as aioredis

from services.gateway.session.core import GatewayCore
from services.gateway.session.request import GenerateRequest
from shared.wire.constants import Names
from shared.process.runtime import Liveness
from shared.settings import GatewaySettings

TTL_S = 5.0


def mark_live(client, names: Names, services=("tokenizer", "scheduler", "worker"), **info) -> None:
    """Each service kind has one live instance, as its own liveness refresh would show it."""
    for service in services:
        Liveness(names, service, f"{service}-1", 1.0, TTL_S).refresh(client, dict(info) if info else None)


def gateway_core(redis_url: str, names: Names, **settings) -> GatewayCore:
    """Call inside the event loop that will use it (the asyncio client binds to it)."""
    s = GatewaySettings(redis_url=redis_url, namespace=names.ns, **settings)
    return GatewayCore(s, aioredis.Redis.from_url(redis_url), None, "test-model")


@contextlib.asynccontextmanager
async def started(core: GatewayCore):
    """The core's loops running for the block, stopped after it whatever it raised."""
    await core.start()
    try:
        yield core
    finally:
        await core.stop()


def small(prompt: str = "Hello") -> GenerateRequest:
    return GenerateRequest(prompt=prompt, max_tokens=2)


def calls(client, command: str) -> int:
    """How many times Redis ran `command` since the last CONFIG RESETSTAT."""
    return client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)
