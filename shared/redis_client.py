"""Redis clients configured the same way in every service."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared.settings import CommonSettings

_RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError)
# Errors after which the same command may succeed a moment later: Redis away, or a Redis Cluster shard between a
# master's death and its replica's promotion (CLUSTERDOWN, TRYAGAIN once the client's own retries are spent).
TRANSIENT_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
                    redis.exceptions.TryAgainError)


def sync_client(settings: CommonSettings) -> redis.Redis:
    # socket_timeout must exceed the XREADGROUP BLOCK, or a quiet stream looks like a dead server.
    return redis.Redis.from_url(
        settings.redis_url, socket_timeout=settings.socket_timeout_s, socket_connect_timeout=5,
        health_check_interval=30, retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 3),
        retry_on_error=list(_RETRY_ERRORS),
    )


def async_client(settings: CommonSettings, max_connections: int = 64, pool_timeout_s: float = 30.0) -> aioredis.Redis:
    """An asyncio client over a bounded, blocking pool: under a burst, coroutines wait (up to pool_timeout_s)
    for a free connection instead of opening one per request until the pool or the server refuses more
    ("Too many connections" would be reported to clients as Redis being down)."""
    from redis.asyncio.retry import Retry as ARetry

    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=max_connections, timeout=pool_timeout_s,
        socket_timeout=settings.socket_timeout_s, socket_connect_timeout=5, health_check_interval=30,
        retry=ARetry(ExponentialBackoff(cap=2.0, base=0.05), 3), retry_on_error=list(_RETRY_ERRORS))
    return aioredis.Redis(connection_pool=pool)
