"""Which processes are alive: one Redis hash per service kind (`Names.live_hash`), never a SCAN.

Field = instance id, value = JSON {"at": the writer's epoch seconds, "ttl": seconds, ...summary}. An entry is
live while now - at <= ttl (so the hosts' clocks must agree to well within the TTL). Readers delete entries
dead for longer than PRUNE_TTLS x ttl, so the hash holds only recent instances; the hash key itself expires
HASH_TTLS x ttl (at least MIN_HASH_TTL_S) after the last write, so a stopped cluster leaves nothing behind.

(A process that comes back after 10 TTLs of silence, between a reader's HGETALL and its HDEL, loses its
fresh entry to the prune; its next refresh, one interval later, writes it again.)

Writes are queued on a pipeline (sync or asyncio alike: queuing does not wait); reads are one HGETALL, plus
one HDEL when something is to be pruned. The logic is in the pure functions; the sync and asyncio readers
only do the I/O around them.
"""

from __future__ import annotations

import math
import time

import msgspec

from shared.wire.constants import Names

PRUNE_TTLS = 10  # readers delete entries dead for this many TTLs
HASH_TTLS = 10  # the hash expires this many TTLs after the last write...
MIN_HASH_TTL_S = 60  # ...and never sooner than this


def encode_entry(ttl_s: float, info: dict | None = None, at: float | None = None) -> bytes:
    """The hash value: the writer's summary plus when it was written and how long it stays live."""
    entry = dict(info or {})
    entry["at"] = entry.get("at") or (time.time() if at is None else at)
    entry["ttl"] = ttl_s
    return msgspec.json.encode(entry)


def entry_at(value: bytes) -> float:
    """When an entry was written (its writer's clock); 0.0 for one that does not decode."""
    try:
        return float(msgspec.json.decode(value)["at"])
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        return 0.0


def hash_ttl_s(ttl_s: float) -> int:
    return max(MIN_HASH_TTL_S, math.ceil(HASH_TTLS * ttl_s))


def queue_write(pipe, names: Names, service: str, instance: str, ttl_s: float, info: dict | None = None) -> None:
    """Queue the refresh of one instance's entry (and of the hash's expiry) on a pipeline; the caller executes."""
    key = names.live_hash(service)
    pipe.hset(key, instance, encode_entry(ttl_s, info))
    pipe.expire(key, hash_ttl_s(ttl_s))


# KEYS: the liveness hash. ARGV: instance, its new entry, the claimant's token, the claimant's now, the hash's TTL.
# Returns nil when the entry was written, else the entry of the live process (another token) that holds the id.
_CLAIM_LUA = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held then
  local ok, e = pcall(cjson.decode, held)
  if ok and type(e) == 'table' and e.token ~= ARGV[3] and tonumber(e.at) and tonumber(e.ttl)
     and tonumber(ARGV[4]) - tonumber(e.at) <= tonumber(e.ttl) then
    return held
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return false
"""


def claim(client, names: Names, service: str, instance: str, ttl_s: float, token: str, now: float | None = None):
    """Write the instance's entry (with token: the process's own random value) unless a live entry of another
    process holds the id, in one step: two processes starting under one id cannot both take it. Returns what the
    client returns (await it on asyncio): None when written, else the holder's entry (JSON bytes)."""
    now = time.time() if now is None else now
    entry = encode_entry(ttl_s, {"token": token}, at=now)
    return client.eval(
        _CLAIM_LUA, 1, names.live_hash(service), instance, entry, token, repr(now), str(hash_ttl_s(ttl_s))
    )


def remove(client, names: Names, service: str, instance: str):
    """Forget one instance (a clean stop); returns what the client returns (await it on asyncio)."""
    return client.hdel(names.live_hash(service), instance)


def split_entries(raw: dict, now: float) -> tuple[dict[str, dict], list[str]]:
    """Decode an HGETALL of a liveness hash: (live instance -> its entry, instances to prune). An entry that
    cannot be decoded is pruned."""
    live: dict[str, dict] = {}
    prune: list[str] = []
    for field, value in raw.items():
        instance = field.decode() if isinstance(field, bytes) else str(field)
        try:
            entry = msgspec.json.decode(value)
            age, ttl = now - float(entry["at"]), float(entry["ttl"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            prune.append(instance)
            continue
        if age <= ttl:
            live[instance] = entry
        elif age > PRUNE_TTLS * ttl:
            prune.append(instance)
    return live, prune


def read_live(client, names: Names, service: str, now: float | None = None) -> dict[str, dict]:
    """Live instances of a service kind -> their entries (sync client)."""
    key = names.live_hash(service)
    live, prune = split_entries(client.hgetall(key), time.time() if now is None else now)
    if prune:
        client.hdel(key, *prune)
    return live


async def aread_live(client, names: Names, service: str, now: float | None = None) -> dict[str, dict]:
    """Live instances of a service kind -> their entries (asyncio client)."""
    key = names.live_hash(service)
    live, prune = split_entries(await client.hgetall(key), time.time() if now is None else now)
    if prune:
        await client.hdel(key, *prune)
    return live


class GatewayWatch:
    """Tracks how long each gateway's liveness entry has been missing, as seen by this reader: dead only once missing
    for longer than ttl_s here too, so a reader back from a Redis outage (every entry stale) judges nobody at once
    (the scheduler cancelling a gateway's requests, a gateway taking over another's background responses)."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.missing_since: dict[str, float] = {}

    def dead(self, live: set[str], referenced: set[str]) -> set[str]:
        now = time.monotonic()
        for gw in referenced - live:
            self.missing_since.setdefault(gw, now)
        for gw in live:
            self.missing_since.pop(gw, None)
        return {gw for gw in referenced - live if now - self.missing_since[gw] > self.ttl_s}
