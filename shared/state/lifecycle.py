"""The request lifecycle: states, the allowed-transitions table, and the one transition function.

Every transition runs as one Lua script in Redis, so it is atomic across processes:
it checks the current state against the table, records the new state with Redis's own
clock (one clock for every interval metric), appends to the request's history, and, in the
same step, publishes the events that must follow it (so "state changed" and "event sent"
can never disagree after a crash). Terminal states have no way out: the first terminal
transition wins, every later attempt is a counted no-op.

On a Redis Cluster the script touches one hash slot only, its request's partition (shared.wire.constants): the
request's keys, the partition's indexes and feed, and the streams of that slot. An event for a stream of
another slot (a worker's inbox, a gateway's replies, the control stream) is published right after the script
says the transition applied: the change is still atomic, its delivery is at-least-once and eventual.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from dataclasses import dataclass
from typing import Collection, Sequence

from shared.process import telemetry
from shared.wire.bus import LUA_XADD_EVENT, event_argv, write_event
from shared.wire.constants import LIFECYCLE_FEED_FIELDS, LIFECYCLE_FEED_MAXLEN, Names
from shared.wire.events import Event, State
from shared.redis_io.replies import as_text

logger = logging.getLogger(__name__)


TERMINAL = frozenset({State.FINISHED, State.FAILED, State.CANCELLED, State.TIMED_OUT})
_ABORT = frozenset({State.FAILED, State.CANCELLED, State.TIMED_OUT})

# from-state -> states it may move to. Anything not listed is refused (Outcome.REFUSED), changing nothing.
ALLOWED: dict[State, frozenset[State]] = {
    State.RECEIVED: frozenset({State.PREPROCESSED}) | _ABORT,
    State.PREPROCESSED: frozenset({State.QUEUED}) | _ABORT,
    State.QUEUED: frozenset({State.SCHEDULED}) | _ABORT,
    # QUEUED again: the worker was lost or handed the request back.
    State.SCHEDULED: frozenset({State.PREFILLING, State.QUEUED}) | _ABORT,
    State.PREFILLING: frozenset({State.DECODING, State.PREEMPTED, State.QUEUED}) | _ABORT,
    State.DECODING: frozenset({State.FINISHED, State.PREEMPTED, State.QUEUED}) | _ABORT,
    State.PREEMPTED: frozenset({State.PREFILLING, State.QUEUED}) | _ABORT,
    State.FINISHED: frozenset(),
    State.FAILED: frozenset(),
    State.CANCELLED: frozenset(),
    State.TIMED_OUT: frozenset(),
}


# How a transition changes the cluster-wide "waiting" set (requests not yet on a worker).
_WAITING_EFFECT = {State.QUEUED: "1", State.SCHEDULED: "-1", **{t: "-1" for t in TERMINAL}}


def lua_feed_xadd(key: str, maxlen: str, **values: str) -> str:
    """The Lua XADD of one feed record, its fields written from shared.wire.constants.LIFECYCLE_FEED_FIELDS (in that
    order; `from` as from_): a script cannot give a field the decoder does not know or leave one out."""
    given = {k.rstrip("_"): v for k, v in values.items()}
    if set(given) != set(LIFECYCLE_FEED_FIELDS):
        raise ValueError(f"a feed record has the fields {LIFECYCLE_FEED_FIELDS}, not {sorted(given)}")
    pairs = ", ".join(f"'{f}', {given[f]}" for f in LIFECYCLE_FEED_FIELDS)
    return f"redis.call('XADD', {key}, 'MAXLEN', '~', {maxlen}, '*', {pairs})"


def lua_in(var: str, states: Collection[State]) -> str:
    """A Lua condition true when `var` holds one of `states`: the scripts' state sets are written from this
    module's sets, never typed again in Lua."""
    return "(" + " or ".join(f"{var} == '{s.value}'" for s in sorted(states)) + ")"


def predecessors(to: State) -> list[str]:
    return [s.value for s, nxt in ALLOWED.items() if to in nxt]


# KEYS: meta, input, exec, kv, output, history, tokens, then the request's partition's counters, waiting set,
#       lifecycle feed, to-state set and owner-waiting set, then the state set of each allowed from-state (in
#       ARGV[2]'s order), then one key per stream to publish to. All in the request's partition: one hash slot.
# ARGV: to, allowed-from (comma list), service, reason, terminal(0|1), ttl, request id, waiting(1|0|-1),
#       number of from-state sets, fence attempt ('' = none), owner attempt ('' = none), owner worker (JSON),
#       feed maxlen, placement nonce (JSON, '' = none), then per stream: payload, stream ttl ('0' = none), maxlen.
# The feed record (shared.wire.constants.LIFECYCLE_FEED_FIELDS) is appended here and only here, after every check: a
# record exists if and only if the transition happened.
# Fencing: a write that a stale owner could make carries the attempt it was placed with; it is refused
# ('fenced') unless exec.attempt still equals it, so a hung worker that wakes up after its request moved on
# changes nothing. exec is written only here (with the SCHEDULED transition), never separately.
# A placement (an owner given) is fenced too: refused ('fenced', with exec.attempt) unless its attempt is above
# exec.attempt, so a replica placing from a stale queue record never sets the attempt back (which would let the
# writes of a worker the request was taken from pass again). It records its nonce (and, on a single Redis, the
# entry id of its event) in exec: the same script re-sent after its reply was lost (a client's retry) finds its own
# placement made and answers 'again' (with that entry id), never a race lost to another replica.
# Keys created after the request's birth (exec) take meta's remaining TTL: every key has a TTL from birth.
# The owner-waiting set's members are `owner NUL request id` (the owner is in meta: only the script knows it).
_TRANSITION_LUA = (
    """
if redis.replicate_commands then redis.replicate_commands() end
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {'missing', ''} end
local terminal = @TERMINAL(cur)
local placed = nil
if ARGV[11] ~= '' then
  placed = redis.call('HMGET', KEYS[3], 'attempt', 'placement', 'placed_entry')
  if ARGV[14] ~= '' and placed[2] == ARGV[14] and not terminal and cur ~= '@QUEUED' then
    local again = {'again', cur, redis.call('HGET', KEYS[1], 'state_since') or '0'}
    if placed[3] then again[4] = cjson.decode(placed[3]) end
    return again
  end
end
local from_i = nil
local i = 0
for s in string.gmatch(ARGV[2], '[^,]+') do
  i = i + 1
  if s == cur then from_i = i end
end
if not from_i then
  if ARGV[5] == '1' and terminal then
    redis.call('HINCRBY', KEYS[8], 'settle_noop', 1)
  end
  return {'rejected', cur}
end
if ARGV[10] ~= '' and redis.call('HGET', KEYS[3], 'attempt') ~= ARGV[10] then return {'fenced', cur} end
if placed and tonumber(placed[1] or '0') >= tonumber(ARGV[11]) then return {'fenced', cur, placed[1]} end
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'state_since', now, 'updated_at', now)
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'reason', ARGV[4]) end
if ARGV[11] ~= '' then
  redis.call('HSET', KEYS[3], 'attempt', ARGV[11], 'worker_id', ARGV[12])
  if ARGV[14] ~= '' then redis.call('HSET', KEYS[3], 'placement', ARGV[14]) end
  local left = redis.call('PTTL', KEYS[1])
  if left > 0 then redis.call('PEXPIRE', KEYS[3], left) end
end
redis.call('RPUSH', KEYS[6], cjson.encode({state=ARGV[1], from=cur, t=tonumber(now), service=ARGV[3], reason=ARGV[4]}))
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner then owner = cjson.decode(owner) end
if type(owner) ~= 'string' then owner = '' end
local worker = ''
if ARGV[11] ~= '' then worker = cjson.decode(ARGV[12]) end
@FEED_XADD
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'ended_at', now)
  for k = 1, 7 do redis.call('EXPIRE', KEYS[k], tonumber(ARGV[6])) end
end
redis.call('ZREM', KEYS[12 + from_i], ARGV[7])
redis.call('ZADD', KEYS[11], now, ARGV[7])
if ARGV[8] ~= '0' then
  local member = nil
  if owner ~= '' then member = owner .. '\\0' .. ARGV[7] end
  if ARGV[8] == '1' then
    redis.call('ZADD', KEYS[9], now, ARGV[7])
    if member then redis.call('ZADD', KEYS[12], 0, member) end
  else
    redis.call('ZREM', KEYS[9], ARGV[7])
    if member then redis.call('ZREM', KEYS[12], member) end
  end
end
local out = {'ok', cur, now}
local first = 13 + tonumber(ARGV[9])
for k = first, #KEYS do
  local a = 15 + 3 * (k - first)
  out[#out + 1] = @XADD_EVENT
end
if ARGV[14] ~= '' and out[4] then redis.call('HSET', KEYS[3], 'placed_entry', cjson.encode(out[4])) end
return out
""".replace(
        "@FEED_XADD",
        lua_feed_xadd(
            "KEYS[10]",
            "ARGV[13]",
            rid="ARGV[7]",
            from_="cur",
            to="ARGV[1]",
            reason="ARGV[4]",
            service="ARGV[3]",
            at="now",
            owner="owner",
            worker="worker",
            attempt="ARGV[11]",
            session="''",
        ),
    )
    .replace("@TERMINAL(cur)", lua_in("cur", TERMINAL))
    .replace("@QUEUED", State.QUEUED.value)
    .replace("@XADD_EVENT", LUA_XADD_EVENT)
)


class Outcome(str, enum.Enum):
    """What a transition attempt found. Only APPLIED and AGAIN changed anything; the others are the ordinary
    results of races between processes (redeliveries, replicas, stale owners), which callers decide about."""

    APPLIED = "applied"  # the state changed
    AGAIN = "again"  # a re-sent placement that found itself made already (applied by its first run)
    ALREADY_THERE = "already_there"  # the request is in the target state already: a redelivery did this
    SETTLED = "settled"  # it ended already (the first terminal wins): a counted no-op
    REFUSED = "refused"  # the table (or the caller's only_from) does not allow the move from its current state
    FENCED = "fenced"  # the caller no longer owns the request (its attempt is stale)
    MISSING = "missing"  # the request has no context (never existed, or expired)


@dataclass(frozen=True)
class TransitionResult:
    status: Outcome
    previous: State | None  # state before the attempt (None: unknown request)
    at: float = 0.0  # Redis time of the change
    entry_ids: tuple[str, ...] = ()  # stream entry ids of the events published with it

    @property
    def applied(self) -> bool:
        """The state changed (by this call, or by its first run for a re-sent placement)."""
        return self.status in (Outcome.APPLIED, Outcome.AGAIN)

    @property
    def fenced(self) -> bool:
        return self.status is Outcome.FENCED

    @property
    def again(self) -> bool:
        return self.status is Outcome.AGAIN

    @property
    def refused(self) -> bool:
        return self.status is Outcome.REFUSED


@dataclass(frozen=True)
class Publish:
    """An event to publish atomically with a transition."""

    stream: str
    event: Event


@dataclass(frozen=True)
class Owner:
    """The placement a SCHEDULED transition records in the exec layer (the fencing token). nonce: this one
    placement's own name, which tells its re-sent script from another replica's placement of the same attempt."""

    worker_id: str
    attempt: int
    nonce: str = ""


class Lifecycle:
    """Performs transitions for one service of one namespace, on a sync or asyncio client.

    `only_from` narrows the table's predecessors (a consumer that knows which state its event moves the
    request from: a redelivered event then finds the request elsewhere and changes nothing); `fence` is the
    attempt the caller holds the request with; `owner` is recorded with a placement."""

    def __init__(self, client, names: Names, service: str, context_ttl_s: int):
        self.names = names
        self.service = service
        self.ttl = context_ttl_s
        self.r = client
        self._script = client.register_script(_TRANSITION_LUA)

    def transition(
        self, request_id: str, to: State, reason: str = "", publish: Sequence[Publish] = (), **kw
    ) -> TransitionResult:
        keys, argv, later = self.args(request_id, to, reason, publish, **kw)
        res = self.interpret(request_id, to, self._script(keys=keys, args=argv))
        if res.applied and later:
            pipe = self.r.pipeline(transaction=False)
            self.publish_after(pipe, later)
            res = _with_ids(res, pipe.execute())
        return res

    async def atransition(
        self, request_id: str, to: State, reason: str = "", publish: Sequence[Publish] = (), **kw
    ) -> TransitionResult:
        keys, argv, later = self.args(request_id, to, reason, publish, **kw)
        res = self.interpret(request_id, to, await self._script(keys=keys, args=argv))
        if res.applied and later:
            pipe = self.r.pipeline(transaction=False)
            self.publish_after(pipe, later)
            res = _with_ids(res, await pipe.execute())
        return res

    def queue(
        self, pipe, request_id: str, to: State, reason: str = "", publish: Sequence[Publish] = (), **kw
    ) -> tuple[Publish, ...]:
        """Add the transition to a pipeline; pass its reply to interpret(). Returns the events that could not go
        with it (streams outside the request's slot, on a cluster; none on a single Redis): once interpret()
        says it applied, send them with publish_after()."""
        keys, argv, later = self.args(request_id, to, reason, publish, **kw)
        self._script(keys=keys, args=argv, client=pipe)
        return later

    def publish_after(self, pipe, publish: Sequence[Publish]) -> None:
        """Queue the XADDs (capped, with a private stream's TTL) of events published after their transition.
        Delivered at least once, never atomically with the change: if the process dies in between, the recovery
        paths stand in (docs/reliability.md, "Redis Cluster")."""
        for p in publish:
            write_event(pipe, self.names, p.stream, p.event)

    def complete(
        self, client, done: Sequence[tuple[TransitionResult, tuple[Publish, ...]]], pipe=None
    ) -> list[TransitionResult]:
        """After a pipeline of queue()d transitions, interpreted: publish the events of the applied ones that could
        not go with them, all in one round trip (none on a single Redis: no round trip), after what `pipe` (a
        plain pipeline of the client's) holds already. Returns the results with those events' entry ids."""
        out = [res for res, _ in done]
        todo = [(i, later) for i, (res, later) in enumerate(done) if res.applied and later]
        if not todo:
            if pipe is not None and len(pipe):
                pipe.execute()
            return out
        pipe, spans = pipe if pipe is not None else client.pipeline(transaction=False), []
        for i, later in todo:
            start = len(pipe)
            self.publish_after(pipe, later)
            spans.append((i, start, len(pipe)))
        replies = pipe.execute()
        for i, start, end in spans:
            out[i] = _with_ids(out[i], replies[start:end])
        return out

    def args(
        self,
        request_id: str,
        to: State,
        reason: str,
        publish: Sequence[Publish],
        only_from: Collection[State] | None = None,
        fence: int | None = None,
        owner: Owner | None = None,
    ) -> tuple[list, list, tuple[Publish, ...]]:
        allowed = predecessors(to) if only_from is None else [s.value for s in only_from if to in ALLOWED[s]]
        n, p = self.names, self.names.partition(request_id)
        now = [x for x in publish if n.colocated(x.stream, p)]
        keys = n.request_keys(request_id) + [
            n.counters(p),
            n.waiting(p),
            n.lifecycle_feed(p),
            n.state_set(p, to.value),
            n.owner_waiting(p),
        ]
        keys += [n.state_set(p, s) for s in allowed] + [x.stream for x in now]
        argv = [
            to.value,
            ",".join(allowed),
            self.service,
            reason,
            "1" if to in TERMINAL else "0",
            str(self.ttl),
            request_id,
            _WAITING_EFFECT.get(to, "0"),
            str(len(allowed)),
            "" if fence is None else str(fence),
            "" if owner is None else str(owner.attempt),
            "" if owner is None else json.dumps(owner.worker_id),
            str(LIFECYCLE_FEED_MAXLEN),
            json.dumps(owner.nonce) if owner is not None and owner.nonce else "",
        ]
        for x in now:
            argv += event_argv(n, x.stream, x.event)
        return keys, argv, tuple(x for x in publish if not n.colocated(x.stream, p))

    def interpret(self, request_id: str, to: State, raw) -> TransitionResult:
        status, cur = as_text(raw[0]), as_text(raw[1])
        if status == "ok":
            at = float(as_text(raw[2]))
            telemetry.transition_event(request_id, to.value, cur, at)  # on the caller's current span, if recording
            return TransitionResult(Outcome.APPLIED, State(cur), at, tuple(as_text(x) for x in raw[3:]))
        if status == "again":  # its first run's reply was lost: the placement is made, its events with it
            logger.info("placement of %s re-sent: found made by its first run", request_id)
            ids = tuple(as_text(x) for x in raw[3:])
            return TransitionResult(Outcome.AGAIN, State(cur), float(as_text(raw[2])), ids)
        if status == "missing":
            logger.warning("transition %s -> %s: request has no context (expired?)", request_id, to.value)
            return TransitionResult(Outcome.MISSING, None)
        current = State(cur)
        if status == "fenced":
            logger.warning("transition %s -> %s refused: the caller's attempt is stale", request_id, to.value)
            return TransitionResult(Outcome.FENCED, current)
        if current in TERMINAL:
            return TransitionResult(Outcome.SETTLED, current)  # a no-op, counted by the script
        if current == to:
            return TransitionResult(Outcome.ALREADY_THERE, current)
        return TransitionResult(Outcome.REFUSED, current)  # the caller judges: a race lost, or a bug to log


def _with_ids(res: TransitionResult, replies) -> TransitionResult:
    """The result with the entry ids of the events published after it (XADD replies; EXPIRE gives integers)."""
    ids = tuple(as_text(x) for x in replies if isinstance(x, (bytes, str)))
    return dataclasses.replace(res, entry_ids=res.entry_ids + ids)


def parse_history(raw: list) -> list[dict]:
    return [json.loads(as_text(x)) for x in raw]
