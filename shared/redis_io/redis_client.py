"""Redis clients configured the same way in every service.

On a single Redis (the default) these are redis-py's plain clients, their pipelines checking a registered script
once a connection (shared.redis_io.scripts); with settings.redis_cluster, the cluster clients of
shared.redis_io.redis_cluster_client (what they add to redis-py's, and why, is said there).
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis import cluster as _sync_cluster
from redis.asyncio import cluster as _async_cluster
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.crc import key_slot as _crc_key_slot
from redis.retry import Retry

# CLUSTER_RETRY_S and NoConnectionAvailable are re-exported: callers know one module for their clients.
from shared.process.backoff import REDIS_BASE_S, REDIS_CAP_S
from shared.redis_io.redis_cluster_aio import AsyncClusterClient
from shared.redis_io.redis_cluster_client import CLUSTER_RETRY_S, NoConnectionAvailable, SyncClusterClient  # noqa: F401
from shared.redis_io.scripts import AsyncRedis, Redis
from shared.settings import CommonSettings

_RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError)
# Errors after which the same command may succeed a moment later: Redis away, or a Redis Cluster shard between a
# master's death and its replica's promotion (CLUSTERDOWN, TRYAGAIN once the client's own retries are spent).
TRANSIENT_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
)


def key_slot(key: str | bytes) -> int:
    """The hash slot (0-16383) of a key, honouring {hash tags}: keys in one slot can share a script or transaction."""
    return _crc_key_slot(key.encode() if isinstance(key, str) else key)


def is_cluster(client) -> bool:
    """Whether client (or pipeline) is one of redis-py's cluster clients."""
    return isinstance(client, (_sync_cluster.RedisCluster, _async_cluster.RedisCluster, _async_cluster.ClusterPipeline))


def _auth(settings: CommonSettings) -> dict:
    """redis_password as the clients' password; a password inside redis_url still wins (redis-py's from_url)."""
    password = settings.redis_password.get_secret_value()
    return {"password": password} if password else {}


def sync_client(settings: CommonSettings) -> redis.Redis | _sync_cluster.RedisCluster:
    # socket_timeout must exceed the XREADGROUP BLOCK, or a quiet stream looks like a dead server.
    if settings.redis_cluster:
        return SyncClusterClient.from_url(
            settings.redis_url,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=5,
            retry=Retry(NoBackoff(), 0),
            **_auth(settings),
        )
    return Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=REDIS_CAP_S, base=REDIS_BASE_S), 3),
        retry_on_error=list(_RETRY_ERRORS),
        **_auth(settings),
    )


def async_client(
    settings: CommonSettings, max_connections: int = 64, pool_timeout_s: float = 30.0
) -> aioredis.Redis | _async_cluster.RedisCluster:
    """An asyncio client over a bounded, blocking pool: under a burst, coroutines wait (up to pool_timeout_s)
    for a free connection instead of opening one per request until the pool or the server refuses more
    ("Too many connections" would be reported to clients as Redis being down). On a cluster: at most
    max_connections operations in flight (so at most that many connections to each node), the others waiting
    their turn up to pool_timeout_s (see the module's docstring)."""
    from redis.asyncio.retry import Retry as ARetry

    if settings.redis_cluster:
        return AsyncClusterClient.from_url(
            settings.redis_url,
            max_connections=max_connections,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=5,
            health_check_interval=30,
            retry=ARetry(NoBackoff(), 0),
            max_in_flight=max_connections,
            pool_timeout_s=pool_timeout_s,
            **_auth(settings),
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=ARetry(ExponentialBackoff(cap=REDIS_CAP_S, base=REDIS_BASE_S), 3),
        retry_on_error=list(_RETRY_ERRORS),
        **_auth(settings),
    )
    return AsyncRedis(connection_pool=pool)
