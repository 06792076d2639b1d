"""Back-pressure at the door: a request enters only while the cluster can take it.

Requests not yet on a worker (RECEIVED, PREPROCESSED, QUEUED) sit in one cluster-wide sorted
set kept by the lifecycle; its size is bounded by `max_waiting_requests`. Beyond it a new
request gets 429 with Retry-After at once and is never created: nothing is accepted only to
wait until its deadline. The check and the creation are serialized inside this gateway, so
one gateway never overshoots the bound; N gateways together can overshoot it by at most N-1
(each has at most one admission between its check and its creation).

Fairness: with API keys set, each key's waiting requests are also in a set of their own (added by the create
script, removed by the lifecycle when they leave the waiting states), bounded by
`max_waiting_requests_per_key` under the same lock, so one key cannot take every waiting slot.

The gateway also bounds the HTTP requests it serves at once, in all and per API key (OpenRequestLimit) and, when a
service the pipeline needs has no live instance, answers 503 instead of queueing work that
nobody would pick up.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis

from services.gateway.auth import STATE_KEY
from services.gateway.errors import Overloaded, Unavailable, error_response
from shared.events import Event

logger = logging.getLogger(__name__)

READY_CACHE_S = 1.0  # a positive readiness check is trusted this long (it reads the liveness hashes)
UNLIMITED_PATHS = ("/health", "/ready")  # probes must answer under any load


class Admission:
    def __init__(self, core):
        self.core = core
        self._lock = asyncio.Lock()
        self._ready_until = 0.0

    def _retry(self) -> dict:
        return {"Retry-After": str(self.core.s.retry_after_s)}

    async def create(self, request_id: str, meta: dict, input_: dict, stream: str, event: Event) -> None:
        """Create the request (state RECEIVED, event published), or raise Overloaded / Unavailable."""
        core = self.core
        try:
            await self._check_ready()
            owner = meta.get("owner") or ""  # the caller's API key id; "" when the gateway has no keys
            async with self._lock:
                pipe = core.r.pipeline(transaction=False)
                pipe.zcard(core.names.waiting)
                if owner:
                    pipe.zcard(core.names.owner_waiting(owner))
                waiting, *mine = await pipe.execute()
                bound = core.s.max_waiting_requests
                if waiting >= bound:
                    raise Overloaded(f"the server is overloaded: {waiting} requests are waiting (limit {bound}); "
                                     f"retry after {core.s.retry_after_s} s", None, "overloaded",
                                     headers=self._retry())
                per_key = core.s.max_waiting_requests_per_key
                if mine and mine[0] >= per_key:
                    raise Overloaded(f"this API key has {mine[0]} requests waiting (limit {per_key}, "
                                     f"CONVEYOR_MAX_WAITING_REQUESTS_PER_KEY); retry after {core.s.retry_after_s} s",
                                     None, "key_overloaded", headers=self._retry())
                await core.store.acreate(request_id, meta, input_, stream, event)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise Unavailable(f"redis unreachable: {e}", None, "redis_unavailable", headers=self._retry()) from e

    async def _check_ready(self) -> None:
        now = time.monotonic()
        if now < self._ready_until:
            return
        found = await self.core.ready()
        missing = [s for s, n in found.items() if n == 0]
        if missing:
            raise Unavailable(f"not ready: no live {', '.join(missing)}", None, "not_ready",
                              extra={"live": found}, headers=self._retry())
        self._ready_until = now + READY_CACHE_S


class OpenRequestLimit:
    """ASGI middleware: at most `limit` HTTP requests in progress, and at most `per_key_limit` of one API key
    (its id is in the scope's state, put there by ApiKeyAuth, which runs first); more get 429 at once."""

    def __init__(self, app, limit: int, retry_after_s: int, per_key_limit: int | None = None):
        self.app, self.limit, self.retry_after_s, self.per_key_limit = app, limit, retry_after_s, per_key_limit
        self.open = 0
        self.open_by_key: dict[str, int] = {}  # only keys with requests open: bounded by `limit`

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in UNLIMITED_PATHS:
            return await self.app(scope, receive, send)
        key = (scope.get("state") or {}).get(STATE_KEY) or ""
        busy = None
        if self.open >= self.limit:
            busy = Overloaded(f"the gateway is serving {self.open} requests (limit {self.limit}); retry after "
                              f"{self.retry_after_s} s", None, "too_many_open_requests")
        elif key and self.per_key_limit is not None and self.open_by_key.get(key, 0) >= self.per_key_limit:
            busy = Overloaded(f"this API key has {self.open_by_key[key]} requests open on this gateway (limit "
                              f"{self.per_key_limit}, CONVEYOR_MAX_OPEN_REQUESTS_PER_KEY); retry after "
                              f"{self.retry_after_s} s", None, "too_many_open_requests_for_key")
        if busy is not None:
            busy.headers = {"Retry-After": str(self.retry_after_s)}
            return await error_response(busy)(scope, receive, send)
        self.open += 1
        if key:
            self.open_by_key[key] = self.open_by_key.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
            if key:
                left = self.open_by_key[key] - 1
                if left:
                    self.open_by_key[key] = left
                else:
                    del self.open_by_key[key]
