"""The context store: each request's layered state in Redis.

Five hashes per request, one per layer (vLLM article in the seeds, "hierarchical context"):
  meta    state, timestamps, priority, deadline, reply destination, trace id
  input   prompt or messages, sampling parameters, prompt token ids
  exec    worker, attempt, step progress
  kv      blocks held, prompt tokens served from the prefix cache
  output  token ids, text, finish reason, metrics
plus a history list (one JSON entry per transition, written by shared.state.lifecycle).
Field values are JSON, so types survive the round trip. Keys expire `context_ttl_s` after
the request ends; until then a generous TTL bounds what an abandoned request can leave.
"""

from __future__ import annotations

import asyncio

from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.wire.constants import LAYERS, LIFECYCLE_FEED_MAXLEN, Names
from shared.wire.events import Event, encode
from shared.state.janitor import ContextJanitor  # noqa: F401 (its home was here: importers keep working)
from shared.state.lifecycle import State, lua_feed_xadd, parse_history
from shared.redis_io.replies import as_text

_json = msgspec.json.Encoder()

# KEYS: meta, input, exec, kv, output, history, tokens, then the request's partition's index, stream (of that
# partition), waiting set, RECEIVED state set, lifecycle feed and owner-waiting set, and when the request has an
# owner (an API key id, meta 'owner'): the owner's index in the partition and the partition's request owners.
# ARGV: ttl, request_id, payload, waiting bound ('' = none), owner's waiting bound ('' = none), n_meta,
#       feed maxlen, waiting in the other partitions, the owner's waiting in the other partitions, owner ('' =
#       none), meta k/v pairs..., input k/v pairs...
# The birth's feed record (from '') is appended once the request exists, like every later transition's.
# The bounds are checked here, in the same atomic step as the creation, so no admission has to wait for another
# (and N gateways cannot overshoot them) -- exactly on one partition (a single Redis); with several, the other
# partitions' counts are read just before (ARGV 8 and 9): gateways creating at once may overshoot by a few.
_CREATE_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'exists', redis.call('HGET', KEYS[1], 'created_at') or '', redis.call('HGET', KEYS[1], 'gateway') or ''}
end
if ARGV[4] ~= '' then
  local waiting = redis.call('ZCARD', KEYS[10]) + tonumber(ARGV[8])
  if waiting >= tonumber(ARGV[4]) then return {'overloaded', tostring(waiting)} end
end
local owner = ARGV[10]
if ARGV[5] ~= '' and owner ~= '' then
  local mine = redis.call('ZLEXCOUNT', KEYS[13], '[' .. owner .. '\\0', '(' .. owner .. '\\1') + tonumber(ARGV[9])
  if mine >= tonumber(ARGV[5]) then return {'key_overloaded', tostring(mine)} end
end
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
local n = tonumber(ARGV[6])
redis.call('HSET', KEYS[1], 'state', '@RECEIVED', 'state_since', now, 'created_at', now, 'updated_at', now)
for i = 11, 10 + 2 * n, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
for i = 11 + 2 * n, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('RPUSH', KEYS[6], cjson.encode({state='@RECEIVED', from='', t=tonumber(now), service='gateway', reason=''}))
for i = 1, 6 do redis.call('EXPIRE', KEYS[i], tonumber(ARGV[1])) end
redis.call('ZADD', KEYS[8], now, ARGV[2])
redis.call('ZADD', KEYS[10], now, ARGV[2])
redis.call('ZADD', KEYS[11], now, ARGV[2])
if owner ~= '' then
  redis.call('ZADD', KEYS[13], 0, owner .. '\\0' .. ARGV[2])
  redis.call('ZADD', KEYS[14], now, ARGV[2])
  redis.call('HSET', KEYS[15], ARGV[2], owner)
end
@FEED_XADD
redis.call('XADD', KEYS[9], 'MAXLEN', '~', '100000', '*', 'e', ARGV[3])
return {'ok', now}
""".replace(
    "@FEED_XADD",
    lua_feed_xadd(
        "KEYS[12]",
        "ARGV[7]",
        rid="ARGV[2]",
        from_="''",
        to="'@RECEIVED'",
        reason="''",
        service="'gateway'",
        at="now",
        owner="owner",
        worker="''",
        attempt="''",
        session="''",
    ),
).replace("@RECEIVED", State.RECEIVED.value)


# KEYS: meta, the layer[, exec]. ARGV: the fencing attempt ('' = none; else KEYS[3] is the exec layer), then
# field, value pairs. 1 written, 0 the context is gone, -1 fenced (exec.attempt moved on: a stale owner).
_UPDATE_LUA = """
local left = redis.call('PTTL', KEYS[1])
if left == -2 then return 0 end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[3], 'attempt') ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[2], unpack(ARGV, 2))
if left > 0 then redis.call('PEXPIRE', KEYS[2], left) end
return 1
"""


@dataclass(frozen=True)
class WaitingBounds:
    """Most requests waiting (not yet on a worker) beyond which a new one is not created; None = no bound."""

    total: int | None = None  # cluster-wide
    per_owner: int | None = None  # of the new request's owner (API key id), when it has one


class WaitingFull(Exception):
    """A bound of WaitingBounds was reached: `which` is overloaded (all) or key_overloaded (the owner's)."""

    def __init__(self, which: str, waiting: int):
        super().__init__(f"{which}: {waiting} waiting")
        self.which, self.waiting = which, waiting


@dataclass
class Snapshot:
    """One request's context as read back."""

    request_id: str
    state: State | None
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "state": self.state.value if self.state else None,
            "history": self.history,
            **self.layers,
        }


class ContextStore:
    def __init__(self, client, names: Names, live_ttl_s: int):
        self.names = names
        self.live_ttl_s = live_ttl_s  # bound on an unfinished request's keys
        self._create = client.register_script(_CREATE_LUA)
        self._update = client.register_script(_UPDATE_LUA)
        self._counting: dict[str, asyncio.Task] = {}  # owner -> the waiting-count read in flight (asyncio only)

    def create_args(
        self,
        request_id: str,
        meta: dict,
        input_: dict,
        event: Event,
        bounds: WaitingBounds | None = None,
        elsewhere: tuple[int, int] = (0, 0),
        stream: str = "",
    ):
        """stream: where the event goes, the partition's received stream unless given (a test's sink, in the
        same slot)."""
        n, p = self.names, self.names.partition(request_id)
        keys = n.request_keys(request_id) + [
            n.requests_index(p),
            stream or n.received_stream(p),
            n.waiting(p),
            n.state_set(p, "RECEIVED"),
            n.lifecycle_feed(p),
            n.owner_waiting(p),
        ]
        if owner := meta.get("owner") or "":  # no API keys: no per-owner index or bound
            keys += [n.owner_index(p, owner), n.request_owners(p)]
        b = bounds or WaitingBounds()
        argv: list = [
            str(self.live_ttl_s),
            request_id,
            encode(event),
            "" if b.total is None else str(b.total),
            "" if b.per_owner is None else str(b.per_owner),
            str(len(meta)),
            str(LIFECYCLE_FEED_MAXLEN),
            str(elsewhere[0]),
            str(elsewhere[1]),
            owner,
        ]
        for k, v in meta.items():
            argv += [k, _json.encode(v)]
        for k, v in input_.items():
            argv += [k, _json.encode(v)]
        return keys, argv

    async def waiting_elsewhere(self, client, request_id: str, owner: str, bounds: WaitingBounds) -> tuple[int, int]:
        """Waiting requests (all, and the owner's) in the partitions other than the request's own (its own are
        counted by the creating script): skipped when there is one partition or no bound."""
        if self.names.partitions == 1 or (bounds.total is None and (bounds.per_owner is None or not owner)):
            return 0, 0
        totals, owned = await self._waiting_counts(client, owner)
        p = self.names.partition(request_id)
        return sum(totals) - totals[p], (sum(owned) - owned[p]) if owned else 0

    async def _waiting_counts(self, client, owner: str) -> tuple[list[int], list[int]]:
        """Every partition's waiting count (and the owner's), one pipelined read (a round trip per node) shared by
        the admissions arriving while it is in flight: a burst of N sends a few reads, not N of 2 x partitions
        commands each. An admission may thus miss those created in the read's last milliseconds, as two gateways
        reading at once do (docs/deploy.md: the bound may be overshot by a few on a cluster)."""
        task, loop = self._counting.get(owner), asyncio.get_running_loop()
        if task is None or task.get_loop() is not loop:  # (a loop closed with it in flight: a test's)
            task = loop.create_task(self._read_waiting(client, owner))
            self._counting[owner] = task  # in flight only: bounded by the owners admitting at once
            task.add_done_callback(lambda _t: self._counting.pop(owner, None))
        return await asyncio.shield(task)

    async def _read_waiting(self, client, owner: str) -> tuple[list[int], list[int]]:
        parts = self.names.all_partitions
        pipe = client.pipeline(transaction=False)
        for p in parts:
            pipe.zcard(self.names.waiting(p))
        for p in parts if owner else ():
            pipe.zlexcount(self.names.owner_waiting(p), f"[{owner}\0", f"({owner}\1")
        got = await pipe.execute()
        return got[: len(parts)], got[len(parts) :]

    async def acreate(
        self,
        request_id: str,
        meta: dict,
        input_: dict,
        event: Event,
        bounds: WaitingBounds | None = None,
        stream: str = "",
    ) -> float:
        """Write meta and input, state RECEIVED, and publish `event` on the request's partition's received stream,
        atomically; or, when the waiting requests (all, or the owner's) are at their bound, create nothing and
        raise WaitingFull. Returns Redis time."""
        b = bounds or WaitingBounds()
        elsewhere = await self.waiting_elsewhere(self._create.registered_client, request_id, meta.get("owner") or "", b)
        keys, argv = self.create_args(request_id, meta, input_, event, b, elsewhere, stream)
        res = await self._create(keys=keys, args=argv)
        status = as_text(res[0])
        if status in ("overloaded", "key_overloaded"):
            raise WaitingFull(status, int(as_text(res[1])))
        if status == "exists" and meta.get("gateway") and as_text(res[2]) == _json.encode(meta["gateway"]).decode():
            # Request ids are fresh random ones: our own id, created by our own gateway, is this very creation,
            # re-sent by the client's retry after its first reply was lost. Done once, as the first run did it.
            return float(as_text(res[1]))
        if status != "ok":
            raise ValueError(f"request id {request_id} exists already")
        return float(as_text(res[1]))

    def update(self, client, request_id: str, layer: str, fields: dict, fence: int | None = None):
        """HSET fields of one layer while the request's context exists, the layer taking meta's remaining TTL
        (a write after settlement or expiry never leaves a key without one); with `fence`, only while exec.attempt
        is still that attempt. Returns what the client returns (await it on asyncio; a pipeline queues it):
        1 written, 0 the context is gone, -1 fenced."""
        assert layer in LAYERS, layer
        keys = [self.names.layer(request_id, "meta"), self.names.layer(request_id, layer)]
        if fence is not None:
            keys.append(self.names.layer(request_id, "exec"))
        argv = ["" if fence is None else str(fence), *(x for k, v in fields.items() for x in (k, _json.encode(v)))]
        return self._update(keys=keys, args=argv, client=client)

    def queue_read(self, pipe, request_id: str) -> None:
        for layer in LAYERS:
            pipe.hgetall(self.names.layer(request_id, layer))
        pipe.lrange(self.names.history(request_id), 0, -1)

    def decode_read(self, request_id: str, results: list) -> Snapshot | None:
        layer_maps, history = results[: len(LAYERS)], results[len(LAYERS)]
        if not layer_maps[0]:
            return None
        layers = {
            name: {as_text(k): msgspec.json.decode(v) if _looks_json(v) else as_text(v) for k, v in m.items()}
            for name, m in zip(LAYERS, layer_maps)
        }
        state = layers["meta"].get("state")
        return Snapshot(request_id, State(state) if state else None, layers, parse_history(history))

    def read(self, client, request_id: str) -> Snapshot | None:
        pipe = client.pipeline(transaction=False)
        self.queue_read(pipe, request_id)
        return self.decode_read(request_id, pipe.execute())

    async def aread(self, client, request_id: str) -> Snapshot | None:
        pipe = client.pipeline(transaction=False)
        self.queue_read(pipe, request_id)
        return self.decode_read(request_id, await pipe.execute())


def _looks_json(v) -> bool:
    # The lifecycle script writes plain strings (state as a bare word, timestamps as numbers).
    try:
        msgspec.json.decode(v)
        return True
    except msgspec.DecodeError:
        return False
