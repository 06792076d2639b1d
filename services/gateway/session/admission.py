"""Back-pressure at the door: a request enters only while the cluster can take it.

Requests not yet on a worker (RECEIVED, PREPROCESSED, QUEUED) sit in one cluster-wide sorted
set kept by the lifecycle; its size is bounded by `max_waiting_requests`. Beyond it a new
request gets 429 with Retry-After at once and is never created: nothing is accepted only to
wait until its deadline. The check is made by the script that creates the request, in the same
atomic step: the bound is exact across any number of gateways, and admissions never wait for
each other.

Fairness: with API keys set, each key's waiting requests are also in a set of their own (added by the create
script, removed by the lifecycle when they leave the waiting states), bounded by
`max_waiting_requests_per_key` in the same step, so one key cannot take every waiting slot.

When a service the pipeline needs has no live instance, the gateway answers 503 instead of queueing work that
nobody would pick up. A check that found every service live is trusted for READY_CACHE_S, and admits for
READY_STALE_S while a fresh one runs beside the requests. (It also bounds the HTTP requests it serves at once:
services.gateway.edge.middleware.)
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis

from services.gateway.edge.errors import Overloaded, Unavailable
from shared.state.context_store import WaitingBounds, WaitingFull
from shared.wire.events import Event

logger = logging.getLogger(__name__)

READY_CACHE_S = 1.0  # a positive readiness check is trusted this long (it reads the liveness hashes)
# ... and admits requests this much longer while a fresh check runs beside them: a request arriving a few seconds
# after the last one (a single stream, each request after the one before) does not wait for a ping and three hash
# reads (1.5 ms of its first token on the Xeon VM, 2026-12-07). Within a liveness TTL: a service that died is seen
# as gone no later than its entry says so anyway.
READY_STALE_S = 5.0


class Admission:
    def __init__(self, core):
        self.core = core
        self._ready_at = float("-inf")  # monotonic time of the last check that found the cluster ready
        self._checking: asyncio.Task | None = None  # the readiness check in progress, awaited by every admission

    def _retry(self) -> dict:
        return {"Retry-After": str(self.core.s.retry_after_s)}

    async def create(self, request_id: str, meta: dict, input_: dict, event: Event) -> None:
        """Create the request (state RECEIVED, event published), or raise Overloaded / Unavailable."""
        core = self.core
        bounds = WaitingBounds(core.s.max_waiting_requests, core.s.max_waiting_requests_per_key)
        try:
            await self._check_ready()
            # The bounds are checked by the creating script itself: one round trip, and admissions never wait for
            # each other (a lock held across the check's and the creation's awaits made them one at a time).
            await core.store.acreate(request_id, meta, input_, event, bounds)
        except WaitingFull as e:
            raise self._overloaded(e) from None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise Unavailable(f"redis unreachable: {e}", None, "redis_unavailable", headers=self._retry()) from e

    def _overloaded(self, e: WaitingFull) -> Overloaded:
        s = self.core.s
        if e.which == "key_overloaded":
            return Overloaded(
                f"this API key has {e.waiting} requests waiting (limit {s.max_waiting_requests_per_key}, "
                f"CONVEYOR_MAX_WAITING_REQUESTS_PER_KEY); retry after {s.retry_after_s} s",
                None,
                "key_overloaded",
                headers=self._retry(),
            )
        return Overloaded(
            f"the server is overloaded: {e.waiting} requests are waiting (limit "
            f"{s.max_waiting_requests}); retry after {s.retry_after_s} s",
            None,
            "overloaded",
            headers=self._retry(),
        )

    async def _check_ready(self) -> None:
        """Pass when a recent check found the cluster ready; else wait for a check (raising Unavailable if it finds
        it not ready). A positive check older than READY_CACHE_S is renewed beside the request up to READY_STALE_S."""
        age = time.monotonic() - self._ready_at
        if age < READY_CACHE_S:
            return
        # One check at a time, shared by every request arriving meanwhile: a burst that finds the cache stale
        # must not send one readiness check (a ping and three hash reads) per request.
        if self._checking is None or self._checking.done():
            self._checking = asyncio.get_running_loop().create_task(self._ready_now(), name="admission-ready")
            self._checking.add_done_callback(_seen)
        if age < READY_STALE_S:
            return
        await asyncio.shield(self._checking)

    async def _ready_now(self) -> None:
        try:
            found = await self.core.ready()
        except BaseException:
            self._ready_at = float("-inf")  # the next request waits for a check of its own
            raise
        missing = [s for s, n in found.items() if n == 0]
        if missing:
            self._ready_at = float("-inf")
            raise Unavailable(
                f"not ready: no live {', '.join(missing)}",
                None,
                "not_ready",
                extra={"live": found},
                headers=self._retry(),
            )
        self._ready_at = time.monotonic()


def _seen(task: asyncio.Task) -> None:
    """A check no request waited for: its failure is what the next request waits for a check to hear again (and
    asyncio must not log it as never retrieved)."""
    if not task.cancelled():
        task.exception()
