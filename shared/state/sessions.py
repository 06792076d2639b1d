"""Conversation sessions: their states, the allowed-moves table, and the one move function.

A session ties the turns of one conversation together (X-Session-ID). Each turn is an ordinary request; the
session records what lies between them: whether a turn is running (a second one meanwhile is refused), and where
the conversation's KV was kept when the last turn ended (PAUSED in a worker's pool, SWAPPED to its disk tier), so
the scheduler places the next turn there and the engine prefills only the new tokens.

Who moves it: the gateway starts a turn (-> RUNNING) and ends one that kept nothing (-> OPEN); the worker that
finished a turn pauses it (-> PAUSED, before the turn's completion is published, so a client's next turn finds it
paused), and later swaps it or releases its KV (pressure, idle). Every move is one Lua script over the session's
hash and its owner's index (one slot), checked against the table, with fences: a move for a turn carries that
turn's request id, a worker's move carries the worker's id, so a late write of a turn or a worker the session has
moved past changes nothing (a result, never an exception). Each applied move is also one record of the lifecycle
feed (shared.state.lifecycle_feed), in the partition of the session's turn, written right after the move.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

from shared.wire.constants import LIFECYCLE_FEED_MAXLEN, Names
from shared.wire.events import SessionReason, SessionState
from shared.state.lifecycle import lua_in
from shared.redis_io.redis_client import TRANSIENT_ERRORS
from shared.redis_io.replies import as_text

logger = logging.getLogger(__name__)

S = SessionState

# from-state -> states it may move to. CLOSED is the end: the record is deleted by that move.
ALLOWED: dict[SessionState, frozenset[SessionState]] = {
    S.OPEN: frozenset({S.RUNNING, S.CLOSED}),
    # RUNNING again: only over a turn that ended without anyone ending the session's turn (its gateway died);
    # such a move is fenced on that turn's request id (SessionStore.begin_turn).
    S.RUNNING: frozenset({S.PAUSED, S.OPEN, S.RUNNING, S.CLOSED}),
    S.PAUSED: frozenset({S.RUNNING, S.SWAPPED, S.OPEN, S.CLOSED}),
    S.SWAPPED: frozenset({S.RUNNING, S.OPEN, S.CLOSED}),
    S.CLOSED: frozenset(),
}
KV_KEPT = frozenset({S.PAUSED, S.SWAPPED})  # states in which a worker holds the conversation's KV
# A worker's session figures: fields of its Heartbeat and of its liveness entry, summed by /metrics and the dashboard
# (the kv_swap_* ones count since the worker's start).
SESSION_FIGURES = (
    "sessions_paused",
    "sessions_swapped",
    "session_blocks_paused",
    "session_blocks_swapped",
    "kv_swap_outs",
    "kv_swap_ins",
)


def predecessors(to: SessionState) -> list[SessionState]:
    return [s for s, nxt in ALLOWED.items() if to in nxt]


class Moved(str, enum.Enum):
    """What a move found. Only APPLIED changed anything; the others are the ordinary results of races."""

    APPLIED = "ok"
    MISSING = "missing"  # no such session (never opened, closed, or expired)
    REFUSED = "rejected"  # the table does not allow the move from its current state
    FENCED = "fenced"  # the turn or the worker the move is for is not the session's any more
    LIMIT = "limit"  # creating it would exceed the owner's sessions


@dataclass(frozen=True)
class MoveResult:
    status: Moved
    state: SessionState | None = None  # its state before the move (None: missing)
    current: str = ""  # the request id of its latest turn
    worker: str = ""  # the worker that kept its KV ("" = none)
    count: int = 0  # LIMIT: the owner's sessions now
    at: float = 0.0  # APPLIED: the move's Redis time

    @property
    def applied(self) -> bool:
        return self.status is Moved.APPLIED


# KEYS: the session's hash, its owner's index. ARGV: to, allowed-from (comma list), fence current ('' = none), fence
# worker ('' = none), ttl (s), create limit ('' = do not create; n: create when missing, unless the owner has n),
# session id, reason, then field/value pairs to set. The record's TTL is refreshed by every move (idle sessions
# expire); the index forgets ids idle past the TTL as it goes, so it never outgrows the live sessions.
_MOVE_LUA = (
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ttl = tonumber(ARGV[5])
local cur = redis.call('HGET', KEYS[1], 'state')
local created = false
if not cur then
  if ARGV[6] == '' then return {'missing'} end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
  local n = redis.call('ZCARD', KEYS[2])
  if n >= tonumber(ARGV[6]) then return {'limit', '', '', '', tostring(n)} end
  cur = '@OPEN'
  created = true
  redis.call('HSET', KEYS[1], 'state', cur, 'id', ARGV[7], 'created_at', now, 'state_since', now, 'turns', 0)
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('ZADD', KEYS[2], now, ARGV[7])
  redis.call('EXPIRE', KEYS[2], ttl)
end
local got = redis.call('HMGET', KEYS[1], 'current', 'worker')
local current, worker = got[1] or '', got[2] or ''
if ARGV[2] == '' then
  if created then return {'ok', cur, current, worker, '', tostring(now), ''} end
  return {'rejected', cur, current, worker}
end
local allowed = false
for s in string.gmatch(ARGV[2], '[^,]+') do if s == cur then allowed = true end end
if not allowed then return {'rejected', cur, current, worker} end
if ARGV[3] ~= '' and current ~= ARGV[3] then return {'fenced', cur, current, worker} end
if ARGV[4] ~= '' and worker ~= ARGV[4] then return {'fenced', cur, current, worker} end
if ARGV[1] == '@CLOSED' then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[7])
  return {'ok', cur, current, worker, '', tostring(now)}
end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'state_since', now, 'reason', ARGV[8])
if ARGV[1] == '@RUNNING' then
  redis.call('HINCRBY', KEYS[1], 'turns', 1)
  redis.call('HSET', KEYS[1], 'last_turn_at', now)
end
for i = 9, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if @NO_KV then redis.call('HSET', KEYS[1], 'worker', '', 'kv_blocks', 0, 'tier', '') end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now, ARGV[7])
redis.call('EXPIRE', KEYS[2], ttl)
return {'ok', cur, current, worker, '', tostring(now)}
""".replace("@OPEN", S.OPEN.value)
    .replace("@CLOSED", S.CLOSED.value)
    .replace("@RUNNING", S.RUNNING.value)
    .replace("@NO_KV", lua_in("ARGV[1]", {S.OPEN}))
)


@dataclass(frozen=True)
class Move:
    """One move's arguments (built by SessionStore's methods, run by move/amove)."""

    key: str
    to: SessionState
    reason: SessionReason
    fence_current: str = ""
    fence_worker: str = ""
    create_limit: int | None = None
    only_from: tuple[SessionState, ...] | None = None  # narrower than the table's predecessors
    fields: tuple[tuple[str, str | int | float], ...] = ()

    @property
    def session_id(self) -> str:
        return self.key[self.key.rindex(":s:") + 3 :]

    @property
    def request_id(self) -> str:
        """The turn the move is about ("" when it names none: the result's `current` then)."""
        return self.fence_current or dict(self.fields).get("current", "")

    def redis_keys(self) -> list[str]:
        return [self.key, Names.index_of_session(self.key)]

    def args(self, ttl_s: int) -> list:
        frm = self.only_from if self.only_from is not None else predecessors(self.to)
        bad = [s for s in frm if self.to not in ALLOWED[s]]  # none: only_from=() creates, moving nowhere
        if bad:
            raise ValueError(f"the sessions table allows no move {bad} -> {self.to}")
        sid = self.session_id
        limit = "" if self.create_limit is None else str(self.create_limit)
        head = [self.to.value, ",".join(s.value for s in frm), self.fence_current, self.fence_worker, ttl_s, limit]
        return head + [sid, self.reason.value] + [x for pair in self.fields for x in pair]


def _result(reply) -> MoveResult:
    parts = [as_text(x) for x in reply]
    status = Moved(parts[0])
    state = SessionState(parts[1]) if len(parts) > 1 and parts[1] else None
    current = parts[2] if len(parts) > 2 else ""
    worker = parts[3] if len(parts) > 3 else ""
    count = int(parts[4]) if status is Moved.LIMIT else 0
    at = float(parts[5]) if status is Moved.APPLIED and len(parts) > 5 else 0.0
    # A session created by a move that goes nowhere (open_session) had no state before it.
    if status is Moved.APPLIED and len(parts) > 6:
        state = None
    return MoveResult(status, state, current, worker, count, at)


class SessionStore:
    """Sessions in Redis. Works with a sync client (the worker) and an async one (the gateway): move / amove."""

    def __init__(self, client, names: Names, ttl_s: int, service: str = "gateway"):
        self.r = client
        self.names = names
        self.ttl_s = int(ttl_s)
        self.service = service  # who the feed records say made the moves
        self._script = client.register_script(_MOVE_LUA)

    def key(self, owner: str, session_id: str) -> str:
        return self.names.session(owner, session_id)

    def move(self, m: Move) -> MoveResult:
        res = _result(self._script(keys=m.redis_keys(), args=m.args(self.ttl_s)))
        if res.applied:
            self.record([(m, res)])
        return res

    async def amove(self, m: Move) -> MoveResult:
        res = _result(await self._script(keys=m.redis_keys(), args=m.args(self.ttl_s)))
        if res.applied:
            try:
                await self.r.xadd(*self._feed_entry(m, res), maxlen=LIFECYCLE_FEED_MAXLEN, approximate=True)
            except TRANSIENT_ERRORS as e:
                logger.warning("session move %s -> %s applied, its feed record lost: %r", m.key, m.to.value, e)
        return res

    def record(self, applied: list[tuple[Move, MoveResult]]) -> None:
        """The feed records of applied moves (a sync client; one round trip). A failure loses records, not moves."""
        if not applied:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for m, res in applied:
                pipe.xadd(*self._feed_entry(m, res), maxlen=LIFECYCLE_FEED_MAXLEN, approximate=True)
            pipe.execute()
        except TRANSIENT_ERRORS as e:
            logger.warning("%d session moves applied, their feed records lost: %r", len(applied), e)

    def _feed_entry(self, m: Move, res: MoveResult) -> tuple[str, dict]:
        rid = m.request_id or res.current
        fields = {
            "rid": rid,
            "from": res.state.value if res.state else "",
            "to": m.to.value,
            "reason": m.reason.value,
            "service": self.service,
            "at": repr(res.at),
            "owner": self.names.owner_of_session(m.key),
            "worker": m.fence_worker or str(dict(m.fields).get("worker", "")),
            "attempt": "0",
            "session": m.session_id,
        }
        return self.names.lifecycle_feed(self.names.partition(rid or m.key)), fields

    def queue_move(self, pipe, m: Move) -> None:
        """The move queued on a pipeline / transaction (its reply: decode with result())."""
        self._script(keys=m.redis_keys(), args=m.args(self.ttl_s), client=pipe)

    result = staticmethod(_result)

    async def get(self, key: str) -> dict | None:
        raw = await self.r.hgetall(key)
        if not raw:
            return None
        return {as_text(k): as_text(v) for k, v in raw.items()}

    async def list(self, owner: str, limit: int = 100) -> list[str]:
        ids = await self.r.zrevrangebyscore(
            self.names.sessions_index(owner), "+inf", time.time() - self.ttl_s, 0, limit
        )
        return [as_text(x) for x in ids]


# The moves, one constructor each: who makes which move is written here once.
def begin_turn(key: str, request_id: str, limit: int, over_stale: str = "") -> Move:
    """Gateway: a turn starts (creating the session when it is new). over_stale: the request id of a turn found
    running that has in fact ended (its gateway died before ending it): taken over only if it is still that one."""
    if over_stale:
        return Move(
            key,
            S.RUNNING,
            SessionReason.STALE_TURN,
            fence_current=over_stale,
            only_from=(S.RUNNING,),
            fields=(("current", request_id),),
        )
    frm = tuple(s for s in predecessors(S.RUNNING) if s is not S.RUNNING)
    return Move(
        key, S.RUNNING, SessionReason.TURN, create_limit=limit, only_from=frm, fields=(("current", request_id),)
    )


def end_turn(key: str, request_id: str) -> Move:
    """Gateway: the turn ended and no worker kept its KV (failed, cancelled, timed out)."""
    return Move(key, S.OPEN, SessionReason.TURN_ENDED, fence_current=request_id, only_from=(S.RUNNING,))


def pause(key: str, request_id: str, worker_id: str, blocks: int) -> Move:
    """Worker: the turn finished and its KV is kept in the worker's pool."""
    fields = (("worker", worker_id), ("kv_blocks", blocks), ("tier", "memory"))
    return Move(key, S.PAUSED, SessionReason.TURN, fence_current=request_id, only_from=(S.RUNNING,), fields=fields)


def swapped(key: str, request_id: str, worker_id: str) -> Move:
    """Worker: the paused session's KV moved to its disk tier (the pool needed the blocks)."""
    return Move(key, S.SWAPPED, SessionReason.PRESSURE, request_id, worker_id, fields=(("tier", "disk"),))


def released(key: str, request_id: str, worker_id: str, reason: SessionReason) -> Move:
    """Worker: the session's KV is gone (pressure with no room in the tier, idle, worker stopping)."""
    return Move(key, S.OPEN, reason, request_id, worker_id, only_from=tuple(KV_KEPT))


def open_session(key: str, limit: int) -> Move:
    """Gateway: create the session (OPEN, no turn yet); REFUSED when it exists."""
    return Move(key, S.OPEN, SessionReason.OPENED, create_limit=limit, only_from=())


def close(key: str) -> Move:
    return Move(key, S.CLOSED, SessionReason.CLIENT_CLOSE)
