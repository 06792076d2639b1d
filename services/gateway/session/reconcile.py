"""Repairs what a Redis Cluster can leave undelivered to this gateway (nothing to do on a single Redis).

On a cluster a transition and the events that follow it for the gateway are on different hash slots: the events
are published right after the transition (shared.state.lifecycle), and the tokens reach the request's tokens list in
one transaction and the reply stream after it (services.worker.publisher). A process dying between the two, or a
failover losing a write Redis had acknowledged (replication is asynchronous), can leave tokens in the list that
never reached the reply stream, or a request settled whose ending never comes. The context store is the truth:
- a token delta that skips ahead (the tokens before it never arrived) is held, and the missing tokens are read
  from the list first (fill_gap);
- every heartbeat, requests silent for SILENT_S are looked at (repair_silent): tokens the list has and the
  handle does not are delivered, and a request whose state is terminal gets its ending built from its context.
  Silence is counted in what the reply stream has been read up to (core.replies_read_to), not by the clock: a
  reader behind its stream under load has not missed what it has not read yet. An ending is built only when
  the reader has read ENDING_GRACE_S past the settlement without finding it.
Anything delivered twice is harmless: deltas carry their index, and an ending after the first is ignored.
"""

from __future__ import annotations

import asyncio
import logging

import redis

from services.gateway.session.outcome import ending_from_context
from shared.process.backoff import backoff_s
from shared.wire.events import Failed, TokenDelta
from shared.state.lifecycle import TERMINAL, State

logger = logging.getLogger(__name__)

SILENT_S = 5.0  # a request without any event this long is checked against the context store
ENDING_GRACE_S = 1.0  # an ending is published right after its settlement: later than this, it is not coming
MAX_PER_PASS = 256  # requests checked a heartbeat at most (the longest silent first)
STATE_LOST = "the request's state is gone from Redis (lost in a failover, or expired); send it again"
FILL_TRIES = 10  # reads of a gap's tokens while Redis fails, before going on without them (~10 s)


async def fill_gap(core, h) -> None:
    """Deliver the tokens before h's first held delta from its tokens list, then what was held."""
    try:
        while h.held:
            start, end = h.expected, h.held[0].index
            raw = await _read_tokens(core, h.request_id, start, end)
            if len(raw) < end - start:  # lost from the list too (a failover): go on without them, never hang
                logger.error("request %s: tokens %d..%d missing from its list too", h.request_id, start, end)
                h.expected = end
            else:
                logger.warning(
                    "request %s: %d tokens read from its list (their events never came)", h.request_id, len(raw)
                )
            h.release(TokenDelta(h.request_id, start, tuple(int(t) for t in raw)))
    finally:
        h.filling = False


async def _read_tokens(core, rid: str, start: int, end: int) -> list:
    """Tokens start..end-1 of the request's list; what could be read after FILL_TRIES tries while Redis fails (an
    empty list: the caller goes on without them rather than hold the request's output for ever)."""
    for attempt in range(FILL_TRIES):
        try:
            return await core.r.lrange(core.names.tokens(rid), start, end - 1) if end > start else []
        except redis.RedisError as e:
            logger.warning("request %s: reading its tokens failed (%r); retrying", rid, e)
            await asyncio.sleep(backoff_s(attempt, 0.1, 1.6))
    return []


async def repair_silent(core) -> None:
    read_to = core.replies_read_to
    silent = sorted(
        (
            h
            for h in core.handles.values()
            if h.exists and h.ended is None and not h.filling and read_to - h.last_event_at > SILENT_S
        ),
        key=lambda h: h.last_event_at,
    )[:MAX_PER_PASS]
    if not silent:
        return
    pipe = core.r.pipeline(transaction=False)
    for h in silent:
        pipe.hmget(core.names.layer(h.request_id, "meta"), "state", "state_since")
        pipe.llen(core.names.tokens(h.request_id))
    replies = await pipe.execute()
    for h, (state, since), length in zip(silent, replies[::2], replies[1::2]):
        ended = state is not None and State(state.decode()) in TERMINAL
        if ended and not float(since or 0) < read_to - ENDING_GRACE_S:
            continue  # settled just now: its ending may not be read yet (look again next time)
        h.last_event_at = read_to  # checked: not again before another SILENT_S
        if length > h.expected or h.held:
            h.filling = True
            h.hold(TokenDelta(h.request_id, length, ()))  # a marker delta at the list's end: fills up to it
            await fill_gap(core, h)
        if state is None:
            h.deliver(
                Failed(
                    request_id=h.request_id,
                    reason="state_lost",
                    service="gateway",
                    message=STATE_LOST,
                )
            )
        elif ended:
            if (end := await _ending(core, h.request_id)) is not None:
                logger.warning(
                    "request %s: settled as %s without its ending reaching this gateway; built from its context",
                    h.request_id,
                    state.decode(),
                )
                h.deliver(end)


async def catch_up(core, h) -> bool:
    """Deliver to h what its request's context has and h has not: tokens from its list, and its ending once its
    state is terminal (a request whose reply stream nobody reads: a taken-over background response). True once the
    ending has been delivered (or the request is gone: a failure delivered)."""
    pipe = core.r.pipeline(transaction=False)
    pipe.hget(core.names.layer(h.request_id, "meta"), "state")
    pipe.llen(core.names.tokens(h.request_id))
    state, length = await pipe.execute()  # the state first: tokens listed before a terminal state are all there
    if length > h.expected:
        raw = await _read_tokens(core, h.request_id, h.expected, length)
        h.deliver(TokenDelta(h.request_id, h.expected, tuple(int(t) for t in raw)))
    if state is None:
        h.deliver(Failed(request_id=h.request_id, reason="state_lost", service="gateway", message=STATE_LOST))
        return True
    if State(state.decode()) in TERMINAL and (end := await _ending(core, h.request_id)) is not None:
        h.deliver(end)
        return True
    return False


async def _ending(core, rid: str):
    """The ending the request's context calls for (services.gateway.session.outcome reads it from its state)."""
    return ending_from_context(rid, await core.store.aread(core.r, rid))
