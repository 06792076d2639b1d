"""The gateway's two background loops: the reply-stream reader (every event for this gateway's requests, routed to
their handles) and the keep-alive (the loop's progress mark, the reply stream's TTL, the dataset epoch). Neither
ends on any error: a loop that died would leave /ready at 503 while /health says 200. A mixin of GatewayCore,
whose state (handles, clients, names) they read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import redis

from services.gateway.session import reconcile
from services.gateway.session.tracing import reply_processed
from shared.wire.constants import EVENT_FIELD, GROUP_GATEWAY, PRIVATE_STREAM_TTL_S
from shared.wire.events import Failed, SchemaError, TokenGenerated, decode

if TYPE_CHECKING:
    from services.gateway.session.handle import RequestHandle

logger = logging.getLogger(__name__)

REPLY_READ = 256  # reply stream entries read at a time


class ReplyReader:
    async def _read_replies(self) -> None:
        """Drain this gateway's reply stream for ever: no error ends it (a lost group is made again). A reader
        that died would leave /ready at 503 while /health says 200, and every request here without its tokens."""
        while True:
            try:
                try:
                    await self._read_replies_once()
                except redis.ResponseError as e:
                    if "NOGROUP" not in str(e):
                        raise
                    logger.warning("reply stream group gone (%s): Redis lost its data; creating it again", e)
                    await self._on_data_loss()  # may fail as well (Redis still away): retried like any round
                self._loop_ok["replies"] = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the loop must outlive anything (see the docstring)
                await self._pause("reply stream read", e)

    async def _read_replies_once(self) -> None:
        # NOACK: nothing enters the group's pending list, so no XACK round trip follows a read (at one stream
        # that was half of this gateway's Redis traffic a token). Nothing is lost by it: the stream is this
        # gateway's own, and what a read returns is routed to in-memory handles that die with the process anyway;
        # nothing here ever reads its pending entries back. What was read is trimmed by _keep_alive.
        started = time.time()
        reply = await self.loop_r.xreadgroup(
            GROUP_GATEWAY, self.id, {self.reply_to: ">"}, count=REPLY_READ, block=self.s.read_block_ms, noack=True
        )
        self.replies_read_to = max(self.replies_read_to, _read_to(reply, started, REPLY_READ))
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._route(fields, entry_id)
            if entries:
                self.replies_read_id = entries[-1][0]

    async def _trim_read(self) -> None:
        """Drop the entries read so far from the reply stream (once a heartbeat: the reader's reads carry no
        acknowledgement or trim of their own, and the stream is capped at its writes meanwhile)."""
        if (read := self.replies_read_id) is not None and read != self._trimmed_to:
            await self.loop_r.xtrim(self.reply_to, minid=read, approximate=True)
            self._trimmed_to = read

    @staticmethod
    async def _pause(what: str, e: Exception) -> None:
        if isinstance(e, redis.RedisError):
            logger.warning("%s failed (%r); retrying", what, e)
        else:  # not Redis being away: a defect, logged with where it happened
            logger.exception("%s failed unexpectedly; retrying", what)
        await asyncio.sleep(0.5)

    async def _ensure_group(self) -> None:
        try:
            await self.loop_r.xgroup_create(self.reply_to, GROUP_GATEWAY, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def _on_data_loss(self) -> None:
        """Redis lost its data: make the reply group again, and answer every request created before the loss
        at once (its context, queue entry and placement are gone: nothing would ever end it)."""
        await self._ensure_group()
        await self.epoch.acheck(self.loop_r)
        for handle in [h for h in self.handles.values() if h.epoch != self.epoch.known]:
            handle.deliver(
                Failed(
                    request_id=handle.request_id,
                    reason="state_lost",
                    service="gateway",
                    message="Redis lost the request's state (a restart without persistence or a "
                    "flush) while it was in flight; send it again",
                )
            )

    def _route(self, fields: dict, entry_id: bytes | str = "") -> None:
        try:
            ev = decode(fields[EVENT_FIELD])
        except (SchemaError, KeyError) as e:
            logger.error("undecodable reply entry dropped: %s", e)
            return
        if isinstance(ev, TokenGenerated):
            for item in ev.items:
                if (h := self.handles.get(item.request_id)) is not None:
                    h.deliver(item)
                    self._fill_if_held(h)
        elif (h := self.handles.get(getattr(ev, "request_id", ""))) is not None:
            reply_processed(h, ev, self.reply_to, GROUP_GATEWAY, self.id, entry_id)
            h.deliver(ev)
            self._fill_if_held(h)

    def _fill_if_held(self, h: RequestHandle) -> None:
        """Tokens came after a gap (possible on a Redis Cluster only): read the missing ones from the list."""
        if h.held and not h.filling:
            h.filling = True
            task = asyncio.get_running_loop().create_task(reconcile.fill_gap(self, h))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _keep_alive(self) -> None:
        """The loop's progress mark (the liveness thread's guard), the reply stream's TTL, and the dataset epoch,
        every heartbeat interval, for ever: no error ends it."""
        while True:
            self._loop_moved = time.monotonic()
            try:
                await self.loop_r.expire(self.reply_to, PRIVATE_STREAM_TTL_S)
                await self._trim_read()
                if await self.epoch.acheck(self.loop_r):
                    await self._on_data_loss()
                if self.names.cluster:  # on a single Redis an ending is published with its transition
                    await reconcile.repair_silent(self)
                self._loop_ok["liveness"] = time.monotonic()
            except redis.RedisError as e:
                logger.warning("liveness refresh failed: %r", e)
            except Exception:  # noqa: BLE001 - see the docstring
                logger.exception("liveness refresh failed unexpectedly")
            await asyncio.sleep(self.s.heartbeat_interval_s)


def _read_to(reply, started: float, count: int) -> float:
    """The time a read of the reply stream has read it up to: the read's start when it took all there was (fewer
    than `count` entries), else the time of the last entry it took (a stream id begins with it, in ms)."""
    entries = reply[0][1] if reply else []
    if len(entries) < count:
        return started
    last = entries[-1][0]
    return int((last.decode() if isinstance(last, bytes) else last).split("-")[0]) / 1000
