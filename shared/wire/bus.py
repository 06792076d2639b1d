"""The event bus: Redis Streams with consumer groups (the arq/taskiq-redis recipe).

- Groups are created at start (MKSTREAM), reading from the stream's beginning.
- XREADGROUP blocks for less than the client's socket timeout.
- A consumer XACKs only after the event's effect is durable (its transition/publish ran).
- Consumers are idempotent: lifecycle transitions are compare-and-set, so a redelivered
  event whose effect already happened is acknowledged and dropped.
- `sweep` claims (XAUTOCLAIM) entries left pending by a dead or failing consumer; entries
  delivered `max_deliveries` times go to the dead-letter stream instead, and the service
  is told so it can fail the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import msgspec
import redis
from msgspec import msgpack

from shared.process import telemetry
from shared.wire.constants import EVENT_FIELD, STREAM_MAXLEN, Names, private_stream_ttl
from shared.wire.events import AnyEvent, Event, SchemaError, decode, encode
from shared.redis_io.replies import as_text

logger = logging.getLogger(__name__)


def write_event(pipe, names: Names, stream: str, event: Event, maxlen: int = STREAM_MAXLEN) -> None:
    """The one way an event enters a stream: XADD of its encoding under EVENT_FIELD, capped (approximate MAXLEN: a
    stream never grows without bound), and a process's own stream (a worker's inbox, a gateway's replies) given its
    TTL again, so a dead process's stream does not live on. Queued on `pipe`; the XADD's reply comes first."""
    pipe.xadd(stream, {EVENT_FIELD: encode(event)}, maxlen=maxlen, approximate=True)
    if ttl := private_stream_ttl(names, stream):
        pipe.expire(stream, ttl)


# How a Lua script writes an event (the write_event of scripts): ARGV[a], ARGV[a + 1], ARGV[a + 2] are what
# event_argv gives for the stream KEYS[k]. Its XADD's reply is the entry id.
LUA_XADD_EVENT = """redis.call('XADD', KEYS[k], 'MAXLEN', '~', ARGV[a + 2], '*', 'e', ARGV[a])
  if ARGV[a + 1] ~= '0' then redis.call('EXPIRE', KEYS[k], tonumber(ARGV[a + 1])) end"""


def event_argv(names: Names, stream: str, event: Event) -> list[str | bytes]:
    """A script's arguments for writing `event` to `stream` as write_event does (LUA_XADD_EVENT): its encoding,
    the stream's TTL (0: none) and its cap."""
    return [encode(event), str(private_stream_ttl(names, stream) or 0), str(STREAM_MAXLEN)]


@dataclass(frozen=True)
class Delivery:
    stream: str  # stream it came from
    group: str  # consumer group it was read through
    entry_id: str  # stream entry id
    event: AnyEvent  # decoded event


# (stream, event, why): the typed event, or for an entry that does not decode as one, its raw msgpack map
# (so a request id and reply destination can still be found), or None.
DeadHandler = Callable[[str, "AnyEvent | dict | None", str], None]


class Bus:
    def __init__(
        self,
        client: redis.Redis,
        names: Names,
        consumer: str,
        block_ms: int,
        claim_idle_ms: int,
        max_deliveries: int,
        on_dead: DeadHandler | None = None,
    ):
        self.r = client
        self.names = names
        self.consumer = consumer
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.on_dead = on_dead
        self._turn = 0  # which slot an idle read blocks on next (a cluster: see _read_slots)

    def ensure_group(self, stream: str, group: str) -> None:
        try:
            self.r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def ensure_groups(self, streams: list[str], group: str) -> None:
        for stream in streams:
            self.ensure_group(stream, group)

    def publish(self, stream: str, event: Event, maxlen: int = STREAM_MAXLEN) -> str:
        """One event now (write_event's XADD, capped, with a private stream's TTL); its entry id."""
        pipe = self.r.pipeline(transaction=False)  # one round trip; sent together, so the TTL is never left off
        write_event(pipe, self.names, stream, event, maxlen)
        return as_text(pipe.execute()[0])

    def read(self, streams: list[str], group: str, count: int = 64, block_ms: int | None = None) -> list[Delivery]:
        """New entries of `streams` for this consumer; block_ms=0 means do not block."""
        block = self.block_ms if block_ms is None else block_ms
        groups = self.names.slot_groups(streams)
        if len(groups) == 1:  # a single Redis (or one slot): one read of them all, blocking
            replies = [
                self.r.xreadgroup(
                    group, self.consumer, {s: ">" for s in streams}, count=count, block=block if block > 0 else None
                )
            ]
        else:
            replies = self._read_slots(groups, group, count, block)
        out: list[Delivery] = []
        for stream, entries in (x for reply in replies for x in reply or []):
            out.extend(self._decode_entries(as_text(stream), group, entries))
        return out

    def read_own_pending(self, stream: str, group: str, count: int = 1024) -> list[Delivery]:
        """This consumer's entries of `stream` read and not acknowledged (XREADGROUP from id 0): what a batch cut
        short by an error left, for a stream nothing else claims from (a process's own inbox)."""
        reply = self.r.xreadgroup(group, self.consumer, {stream: "0"}, count=count)
        return [d for s, entries in reply or [] for d in self._decode_entries(as_text(s), group, entries)]

    def _read_slots(self, groups: list[list[str]], group: str, count: int, block: int) -> list:
        """A cluster: one XREADGROUP cannot span hash slots. One non-blocking read per slot, pipelined (a round
        trip per node); when all were empty, a blocking read of one slot for a share of the wait, a different
        slot each time, so an idle consumer neither spins nor leaves another slot's events waiting long."""
        pipe = self.r.pipeline(transaction=False)
        for streams in groups:
            pipe.xreadgroup(group, self.consumer, {s: ">" for s in streams}, count=count)
        replies = pipe.execute()
        if any(replies) or block <= 0:
            return replies
        streams = groups[self._turn % len(groups)]
        self._turn += 1
        return [
            self.r.xreadgroup(
                group, self.consumer, {s: ">" for s in streams}, count=count, block=max(1, block // len(groups))
            )
        ]

    def ack_all(self, deliveries: list[Delivery]) -> None:
        """XACK many deliveries in one round trip (one XACK per stream and group takes all their ids)."""
        by_group: dict[tuple[str, str], list[str]] = {}
        for d in deliveries:
            by_group.setdefault((d.stream, d.group), []).append(d.entry_id)
        if len(by_group) == 1:
            (stream, group), ids = next(iter(by_group.items()))
            self.r.xack(stream, group, *ids)
        elif by_group:
            pipe = self.r.pipeline(transaction=False)
            for (stream, group), ids in by_group.items():
                pipe.xack(stream, group, *ids)
            pipe.execute()

    def process_all(self, deliveries: list[Delivery], handler: Callable[[Delivery], None]) -> None:
        """Run handler on each delivery, acknowledging the handled ones together at the end: one round trip a batch
        instead of one a delivery. If the process dies before that, they are delivered again (consumers are
        idempotent), as one that died between its handler and its XACK would be. A handler that raises leaves
        its entry pending: it is retried after claim_idle_ms and dead-lettered after max_deliveries, so one bad
        event never blocks the group. Redis errors propagate: the whole loop must back off, not this one entry."""
        done: list[Delivery] = []
        try:
            for d in deliveries:
                if self._handle(d, handler):
                    done.append(d)
        finally:
            if done:
                self.ack_all(done)

    def _handle(self, d: Delivery, handler: Callable[[Delivery], None]) -> bool:
        try:
            with telemetry.process_span(d, self.consumer):
                handler(d)
        except redis.RedisError:
            raise
        except Exception:
            logger.exception(
                "handling %s %s from %s failed; it will be retried", type(d.event).__name__, d.entry_id, d.stream
            )
            return False
        return True

    def trim_consumed(self, stream: str) -> None:
        """Drop the entries every group of `stream` is done with (delivered, and none pending before them): a
        stream is a queue here, not a log, and its acknowledged entries would otherwise stay up to the cap."""
        try:
            groups = self.r.xinfo_groups(stream)
        except redis.ResponseError:  # no such stream (yet)
            return
        floors = []
        for g in groups:
            pending = self.r.xpending(stream, g["name"])
            floors.append(as_text(pending["min"]) if pending["pending"] else as_text(g["last-delivered-id"]))
        if floors:
            self.r.xtrim(stream, minid=min(floors, key=entry_key), approximate=False)

    def sweep_all(self, streams: list[str], group: str, count: int = 64) -> list[Delivery]:
        return [d for stream in streams for d in self.sweep(stream, group, count)]

    def sweep(self, stream: str, group: str, count: int = 64) -> list[Delivery]:
        """Claim entries idle longer than claim_idle_ms; dead-letter the over-delivered ones."""
        pending = self.r.xpending_range(stream, group, min="-", max="+", count=count, idle=self.claim_idle_ms)
        for p in pending:
            if p["times_delivered"] >= self.max_deliveries:
                self._dead_letter(stream, group, as_text(p["message_id"]), f"delivered {p['times_delivered']} times")
        if not pending:
            return []
        # Reply: [next-id, entries] (Redis 6.2) or [next-id, entries, deleted-ids] (7.0+).
        entries = self.r.xautoclaim(stream, group, self.consumer, self.claim_idle_ms, start_id="0-0", count=count)[1]
        if entries:
            logger.warning("claimed %d idle entries of %s/%s", len(entries), stream, group)
        return self._decode_entries(stream, group, entries)

    def _decode_entries(self, stream: str, group: str, entries) -> list[Delivery]:
        out = []
        for entry_id, fields in entries:
            eid = as_text(entry_id)
            if fields is None:  # trimmed away while pending
                self.r.xack(stream, group, eid)
                continue
            try:
                out.append(Delivery(stream, group, eid, decode(fields[EVENT_FIELD])))
            except (SchemaError, KeyError) as e:
                self._dead_letter(stream, group, eid, f"poison entry: {e}", raw=fields)
        return out

    def _dead_letter(self, stream: str, group: str, entry_id: str, why: str, raw: dict | None = None) -> None:
        if raw is None:
            found = self.r.xrange(stream, min=entry_id, max=entry_id)
            raw = found[0][1] if found else {}
        event = _best_effort_decode(raw.get(EVENT_FIELD))
        logger.error("dead-lettering %s entry %s (group %s): %s", stream, entry_id, group, why)
        # In this order, not one transaction (the keys are on different slots of a cluster): dying in between
        # dead-letters the entry twice at worst, never loses it.
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(
            self.names.dead_letter_stream,
            {**raw, b"stream": stream, b"group": group, b"entry_id": entry_id, b"why": why},
            maxlen=STREAM_MAXLEN,
        )
        pipe.xack(stream, group, entry_id)
        pipe.hincrby(self.names.counters(0), "dead_letters", 1)
        pipe.execute()
        if self.on_dead is not None:
            self.on_dead(stream, event, why)


def event_field(event, name: str, default=None):
    """A field of a dead-lettered event, typed or raw."""
    if isinstance(event, dict):
        return event.get(name, default)
    return getattr(event, name, default)


def _best_effort_decode(payload: bytes | None):
    if payload is None:
        return None
    try:
        return decode(payload)
    except SchemaError:
        try:
            raw = msgpack.decode(payload)
        except msgspec.DecodeError:
            return None
        return raw if isinstance(raw, dict) else None


def plain_events(entries, what: str):
    """(entry id, event) of each entry of a plain XREAD (a stream every replica reads in full, no group: nothing
    to acknowledge or dead-letter); an entry that is not an event is logged and skipped."""
    for entry_id, fields in entries:
        eid = as_text(entry_id)
        try:
            yield eid, decode(fields[EVENT_FIELD])
        except (SchemaError, KeyError) as e:
            logger.error("unreadable %s entry %s skipped: %s", what, eid, e)


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sortable (milliseconds, sequence) pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
