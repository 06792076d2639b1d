"""One reader of the lifecycle feed per gateway process, fanned out to every connected dashboard.

However many browsers watch, this process makes one blocking XREAD on the feed (and, once a second, one HGETALL of
the workers' liveness entries for the charts); each connection only gets what its key may see. The reader runs
only while somebody watches: the first subscriber starts it, the last one to leave stops it.

Each connection has a bounded queue of batches. A browser that stops reading (a hidden tab, a slow link) does not
make the gateway hold an ever-growing backlog for it: when its queue is full, the backlog is dropped and it is told
to start over from a fresh snapshot (a `reset`), so its memory here never exceeds the bound.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import redis

from shared.process import liveness
from shared.wire.constants import Names
from shared.state.lifecycle_feed import FeedRecord, decode_record
from shared.state.sessions import SESSION_FIGURES

logger = logging.getLogger(__name__)

READ_COUNT = 1000  # feed entries one XREAD returns at most
WORKERS_INTERVAL_S = 1.0  # how often the workers' figures are sent (the charts' resolution)
RESET = ("reset", None)  # queued in place of a dropped backlog
_json = msgspec.json.Encoder()


def sse(event: str, data) -> bytes:
    """One Server-Sent Event."""
    return b"event: " + event.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"


class Subscriber:
    """One dashboard connection: which owner's records it may see (None: all) and its bounded queue of
    encoded events ("sse", bytes), or RESET."""

    def __init__(self, owner: str | None, max_batches: int):
        self.owner = owner
        self.queue: asyncio.Queue = asyncio.Queue(max_batches)
        self.resets = 0  # times its backlog was dropped

    def offer(self, item: tuple[str, object]) -> None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            while not self.queue.empty():  # drop the whole backlog: the browser reloads a snapshot instead
                self.queue.get_nowait()
            self.queue.put_nowait(RESET)
            self.resets += 1


class FeedHub:
    def __init__(self, client_factory, names: Names, block_ms: int, max_batches: int):
        self._client_factory = client_factory  # a fresh client of its own: its XREAD blocks a connection
        self.names = names
        self.block_ms = block_ms
        self.max_batches = max_batches
        self.subscribers: set[Subscriber] = set()
        self._task: asyncio.Task | None = None
        self._starting = asyncio.Lock()  # two first subscribers at once start one reader
        self.batches_read = 0  # XREADs that returned records (for tests and the cost benchmark)

    async def subscribe(self, owner: str | None) -> Subscriber:
        """A new connection. When it returns, every record appended from now on will reach it: the caller reads
        its snapshot after this, so nothing falls between the two (a record in both is applied once)."""
        sub = Subscriber(owner, self.max_batches)
        self.subscribers.add(sub)
        async with self._starting:
            if self._task is None or self._task.done():
                client = self._client_factory()
                try:
                    # The reader's start is fetched before the caller's snapshot, not lazily by the task: a
                    # transition made between the snapshot and a later start would reach nobody.
                    start = await self._tail_id(client)
                except BaseException:
                    self.subscribers.discard(sub)
                    await client.aclose()
                    raise
                self._task = asyncio.get_running_loop().create_task(self._run(client, start), name="dashboard-feed")
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        if not self.subscribers and self._task is not None:
            self._task.cancel()  # nobody watches: no reads at all (its client is closed by _run's finally)
            self._task = None

    async def stop(self) -> None:
        self.subscribers.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self, client, last: dict[str, str]) -> None:
        try:
            next_workers = 0.0
            while True:
                try:
                    if time.monotonic() >= next_workers:
                        next_workers = time.monotonic() + WORKERS_INTERVAL_S
                        self._broadcast("workers", await worker_figures(client, self.names))
                    last = await self._read_once(client, last)
                except redis.RedisError as e:
                    logger.warning("dashboard feed read failed (%r); retrying", e)
                    await asyncio.sleep(0.5)
        finally:
            await client.aclose()

    async def _tail_id(self, client) -> dict[str, str]:
        """Each partition's feed's newest record id: what came before is in the snapshot each connection gets."""
        pipe = client.pipeline(transaction=False)
        feeds = [self.names.lifecycle_feed(p) for p in self.names.all_partitions]
        for feed in feeds:
            pipe.xrevrange(feed, count=1)
        return {feed: newest[0][0].decode() if newest else "0-0" for feed, newest in zip(feeds, await pipe.execute())}

    async def _read_once(self, client, last: dict[str, str]) -> dict[str, str]:
        if len(groups := self.names.slot_groups(list(last))) == 1:  # a single Redis: one blocking XREAD of all
            replies = [await client.xread(last, count=READ_COUNT, block=self.block_ms)]
        else:  # a cluster's partitions are on several slots: one read each, polled (a dashboard needs no less)
            pipe = client.pipeline(transaction=False)
            for group in groups:
                pipe.xread({f: last[f] for f in group}, count=READ_COUNT)
            replies = await pipe.execute()
            if not any(replies):
                await asyncio.sleep(self.block_ms / 1000)
        records: list[FeedRecord] = []
        for stream, entries in (x for reply in replies for x in reply or []):
            for entry_id, fields in entries:
                last[stream.decode() if isinstance(stream, bytes) else stream] = entry_id.decode()
                try:
                    records.append(decode_record(entry_id, fields))
                except (KeyError, ValueError) as e:
                    logger.error("malformed feed record skipped: %s", e)
        if records:
            self.batches_read += 1
            self._fan_out(records)
        return last

    def _fan_out(self, records: list[FeedRecord]) -> None:
        wire = [(r.owner, r.to_wire()) for r in records]
        everything: bytes | None = None  # encoded once for every connection that sees all
        for sub in list(self.subscribers):
            if sub.owner is None:
                everything = everything or sse("feed", [w for _o, w in wire])
                sub.offer(("sse", everything))
            elif items := [w for o, w in wire if o == sub.owner]:
                sub.offer(("sse", sse("feed", items)))

    def _broadcast(self, event: str, data) -> None:
        encoded = sse(event, data)
        for sub in list(self.subscribers):
            sub.offer(("sse", encoded))


async def worker_figures(client, names: Names) -> dict:
    """The live workers' heartbeat summaries (one HGETALL): running, waiting, KV blocks, step time, preemptions,
    sessions paused and swapped.
    Cluster-wide load, like /metrics shows to any key; no request of anyone is in it."""
    live = await liveness.aread_live(client, names, "worker")
    keep = (
        "running",
        "waiting",
        "held",
        "total_blocks",
        "free_blocks",
        "cached_blocks",
        "preemptions",
        "step",
        "step_time_s",
        *SESSION_FIGURES,
    )
    return {"at": time.time(), "workers": {w: {k: e.get(k) for k in keep} for w, e in sorted(live.items())}}
