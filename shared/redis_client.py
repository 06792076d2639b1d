"""Redis clients configured the same way in every service."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared.settings import CommonSettings

_RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError)


def sync_client(settings: CommonSettings) -> redis.Redis:
    # socket_timeout must exceed the XREADGROUP BLOCK, or a quiet stream looks like a dead server.
    return redis.Redis.from_url(
        settings.redis_url, socket_timeout=settings.socket_timeout_s, socket_connect_timeout=5,
        health_check_interval=30, retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 3),
        retry_on_error=list(_RETRY_ERRORS),
    )


def async_client(settings: CommonSettings) -> aioredis.Redis:
    from redis.asyncio.retry import Retry as ARetry

    return aioredis.Redis.from_url(
        settings.redis_url, socket_timeout=settings.socket_timeout_s, socket_connect_timeout=5,
        health_check_interval=30, retry=ARetry(ExponentialBackoff(cap=2.0, base=0.05), 3),
        retry_on_error=list(_RETRY_ERRORS),
    )
