"""The gateway's link to the bus: submit requests, route replies to their handles, cancel.

One reply stream per gateway process; a single reader task drains it and hands each event
to the request's handle. Entries are read without acknowledgement (NOACK): their only consumer
is this process, which holds the client connections they are for, so a pending list would
hold nothing anyone could take over.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

import redis
from prometheus_client import Gauge

from services.gateway.conversation import turns
from services.gateway.session.admission import Admission
from services.gateway.edge.errors import Unavailable
from services.gateway.session.feed_hub import FeedHub
from services.gateway.session.handle import RequestHandle
from services.gateway.session.received import Placement, input_layer, received_event, sampling_of, stop_strings
from services.gateway.session.replies import ReplyReader
from services.gateway.text.logprobs import TokenStrings
from services.gateway.session.metrics import GatewayMetrics
from services.gateway.text.stop_strings import TextStream
from services.gateway.session.tracing import active, finish_trace, published, refused, start_trace
from shared.state.context_store import ContextStore
from shared.wire.errors import FatalError
from shared.wire.events import CancelRequested, Cancelled, Constraint, TimedOut
from shared.state.lifecycle import Lifecycle, Publish, State
from shared.process import liveness
from shared.state.epoch import DatasetEpoch
from shared.redis_io.redis_client import async_client, sync_client
from shared.process.runtime import Liveness, LivenessThread, instance_id
from shared.state.sessions import SessionStore
from shared.process.service_table import BUS_SERVICES
from shared.settings import GatewaySettings

if TYPE_CHECKING:
    from services.gateway.session.request import GenerateRequest

logger = logging.getLogger(__name__)

LOOP_STALE_S = 10.0  # a background loop with no good round for this long (plus its interval) makes /ready 503
# The liveness entry is refreshed by a thread (shared.process.runtime.LivenessThread) while the event loop moved within
# this long: a stall of seconds is not a dead gateway, an event loop stuck for a minute is.
LOOP_DEAD_S = 60.0
LOOP_CONNECTIONS = 2  # the background loops' own Redis connections: the reply reader's and the liveness refresh's
# Reads that look into the cluster (/ready, /v1/requests, /metrics, the dashboard's API) have a pool of their own:
# they are exempt from the open-request limit (a saturated gateway is when they are needed), so on the request
# pool a flood of them could hold every connection requests are created with. Here they wait for each other only.
OPS_CONNECTIONS = 4
OPS_POOL_TIMEOUT_S = 30.0


async def cancel_until_done(tasks, timeout_s: float) -> set:
    """Cancel tasks until they end (or timeout_s passes); returns those still running. A cancellation that
    lands inside redis-py's blocking read can be absorbed there, so one cancel() is not always enough."""
    loop = asyncio.get_running_loop()
    deadline, pending = loop.time() + timeout_s, {t for t in tasks if not t.done()}
    while pending and loop.time() < deadline:
        for t in pending:
            t.cancel()
        _done, pending = await asyncio.wait(pending, timeout=0.1)
    return pending


class GatewayCore(ReplyReader):
    def __init__(self, settings: GatewaySettings, client, tokenizer, model_name: str, max_len: int = 0):
        self.s = settings
        self.max_len = max_len  # the model's context window in tokens (0: unknown, a core without a model)
        self.r = client  # request traffic: a bounded pool that a burst can hold entirely
        # The background loops have connections of their own: queued behind a burst's requests for a pooled
        # connection, the liveness refresh fell behind the liveness TTL and the scheduler cancelled every request
        # of this (live) gateway as orphaned, and tokens waited in Redis while their clients waited for them.
        self.loop_r = async_client(settings, LOOP_CONNECTIONS, settings.redis_pool_timeout_s)
        self.ops_r = async_client(settings, OPS_CONNECTIONS, OPS_POOL_TIMEOUT_S)
        self.names = settings.names()
        self.id = instance_id(settings, "gateway")
        self.token = uuid.uuid4().hex  # this process's mark in its liveness entry: another under its id is refused
        self._loop_moved = time.monotonic()  # set by the event loop's keep-alive round; read by the liveness thread
        self.liveness = LivenessThread(
            sync_client(settings),
            Liveness.of(settings, "gateway", self.id),
            lambda: time.monotonic() - self._loop_moved < LOOP_DEAD_S,
            info={"token": self.token},
        )
        self.reply_to = self.names.reply_stream(self.id)
        self.tokenizer = tokenizer
        self.token_strings = TokenStrings(tokenizer)  # log probabilities' token strings and bytes
        self.model_name = model_name
        self.lifecycle = Lifecycle(client, self.names, "gateway", settings.context_ttl_s)
        self.store = ContextStore(client, self.names, int(settings.request_timeout_s) + settings.context_ttl_s)
        self.sessions = SessionStore(client, self.names, settings.session_ttl_s)
        self.handles: dict[str, RequestHandle] = {}
        self.metrics = GatewayMetrics()
        self.draining = False  # set on SIGTERM: no new requests, /ready says 503
        self.admission = Admission(self)
        self.epoch = DatasetEpoch(self.names)
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # cancels of abandoned requests (kept referenced)
        self._loop_ok: dict[str, float] = {}  # loop name -> monotonic time of its last good round
        # Wall time up to which the reply stream has been read: every event published before it has been routed.
        # Behind the clock when the reader lags; what services.gateway.session.reconcile measures silence against.
        self.replies_read_to = 0.0
        self.replies_read_id: bytes | str | None = None  # the last reply entry read (the stream is trimmed to it)
        self._trimmed_to: bytes | str | None = None
        # The dashboards' one reader of the lifecycle feed, with a connection of its own (its XREAD blocks).
        self.feed_hub = FeedHub(
            lambda: async_client(settings, 1, settings.redis_pool_timeout_s),
            self.names,
            settings.read_block_ms,
            settings.dashboard_queue_events,
        )
        self._gauges()

    def _gauges(self) -> None:
        """The gauges Prometheus reads from the core's own structures at each scrape."""
        Gauge(
            "conveyor:gateway_open_requests", "requests this gateway holds a client for", registry=self.metrics.registry
        ).set_function(lambda: len(self.handles))
        Gauge(
            "conveyor:gateway_dashboard_connections",
            "dashboards connected to this gateway's event stream",
            registry=self.metrics.registry,
        ).set_function(lambda: len(self.feed_hub.subscribers))

    async def start(self) -> None:
        await self._claim_id()
        await self._ensure_group()
        await self.epoch.acheck(self.r)
        self.liveness.start()
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="replies"),
            asyncio.create_task(self._keep_alive(), name="liveness"),
        ]

    async def _claim_id(self) -> None:
        """Take this gateway's liveness entry, or refuse to start (FatalError) while a live gateway holds its id:
        two under one id read each other's replies, and once one stops the scheduler cancels the other's requests
        as orphaned. An entry a dead predecessor left (never refreshed again) is waited out: at most its TTL."""
        ttl, first_seen = self.s.liveness_ttl_s, None
        deadline = time.monotonic() + 2 * ttl + self.s.heartbeat_interval_s
        while (held := await liveness.claim(self.loop_r, self.names, "gateway", self.id, ttl, self.token)) is not None:
            at = liveness.entry_at(held)
            refreshed = first_seen is not None and at != first_seen
            if refreshed or time.monotonic() > deadline:
                raise FatalError(
                    f"CONVEYOR_INSTANCE_ID {self.id!r} is held by a live gateway (its liveness entry "
                    f"was refreshed {time.time() - at:.1f} s ago): give each gateway its own id, or "
                    f"leave the setting empty for a made-up one"
                )
            if first_seen is None:
                logger.warning(
                    "gateway id %s has a live entry: waiting up to %.1f s to see whether its holder is alive",
                    self.id,
                    ttl,
                )
                first_seen = at
            await asyncio.sleep(min(0.1, self.s.heartbeat_interval_s))

    async def stop(self) -> None:
        await self.feed_hub.stop()
        pending = await cancel_until_done(self._tasks, 5.0)
        if pending:  # a task that ignores cancellation must not hold the process up
            logger.error("background tasks did not stop: %s", [t.get_name() for t in pending])
        await asyncio.to_thread(self.liveness.stop)
        try:
            async with asyncio.timeout(5.0):
                await liveness.remove(self.loop_r, self.names, "gateway", self.id)
        except (redis.ConnectionError, redis.TimeoutError, TimeoutError) as e:
            logger.warning("could not remove the liveness key (it expires by itself): %r", e)
        await self.loop_r.aclose()
        await self.ops_r.aclose()
        logger.info("gateway core stopped")

    async def submit(
        self,
        req: GenerateRequest,
        max_tokens: int,
        traceparent: str = "",
        owner: str = "",
        extra_meta: dict | None = None,
        route: str = "/generate",
        request_id: str = "",
        group_id: str = "",
        group_size: int = 1,
        constraint: Constraint | None = None,
        tools: str = "",
        session: str = "",
        session_worker: str = "",
    ) -> RequestHandle:
        """Create the request (or raise Overloaded/Unavailable); owner: the caller's API key id. A choice of an
        n > 1 request comes with its id and its group's (intake.accept_choices); constraint and tools: what
        openai.structured_output.plan_chat decided (already checked); session: the key of the conversation session
        whose turn it is (its turn started: conversation.turns.begin), session_worker: where its KV is."""
        self._refuse_while_draining()
        rid = request_id or uuid.uuid4().hex  # 128 random bits
        t0, now = time.perf_counter(), time.time()
        deadline = now + (req.timeout or self.s.request_timeout_s)
        sampling = sampling_of(req, max_tokens, constraint)
        rt = start_trace(rid, req, sampling, self.model_name, route, traceparent, t0)  # honours the client's
        placement = Placement(group_id, group_size, session, session_worker)
        ev = received_event(
            req,
            rid,
            sampling,
            reply_to=self.reply_to,
            received_at=now,
            deadline=deadline,
            traceparent=rt.publish_tp,
            tools=tools,
            placement=placement,
        )
        stops = stop_strings(req)
        handle = self._open_handle(rid, rt, stops, deadline, t0, session, req.logprobs is not None)
        meta = self._meta_layer(req, deadline, rt.traceparent, owner, extra_meta)
        await self._create_context(rid, rt, meta, input_layer(req, sampling, stops), ev)
        handle.created()
        published(rt, rid, self.names.received_stream(self.names.partition(rid)))
        return handle

    def _refuse_while_draining(self) -> None:
        if self.draining:
            raise Unavailable(
                "the gateway is shutting down; retry on another", None, "shutting_down", headers={"Retry-After": "1"}
            )

    async def _create_context(self, rid: str, trace, meta: dict, input_: dict, ev) -> None:
        """The request's context created through admission; refused, its handle is forgotten and its trace says
        why."""
        try:
            await self.admission.create(rid, meta, input_, ev)
        except BaseException as e:
            self.handles.pop(rid, None)
            refused(trace, e)
            raise

    def _open_handle(self, rid, trace, stops, deadline, t0, session, logprobs: bool) -> RequestHandle:
        handle = RequestHandle(rid, self.reply_to, TextStream(self.tokenizer, stops), deadline, t0)
        handle.trace = trace
        handle.session = session
        handle.epoch = self.epoch.known
        handle.logprobs = [] if logprobs else None
        self.handles[rid] = handle  # before publishing: the first reply may come back at once
        return handle

    def _meta_layer(self, req: GenerateRequest, deadline: float, traceparent: str, owner: str, extra) -> dict:
        """The context's meta layer: who asked, through which gateway, by when (owner: the caller's key id)."""
        return {
            "model": self.model_name,
            "priority": req.priority,
            "deadline": deadline,
            "timeout": req.timeout,
            "deadline_source": "adaptive" if req.timeout is None else "client",
            "reply_to": self.reply_to,
            "gateway": self.id,
            "stream": req.stream,
            "traceparent": traceparent,
            "owner": owner,
            **(extra or {}),
        }

    def release(self, handle: RequestHandle) -> None:
        """Forget a request whose client has its answer (or left); its Prometheus figures move here, once. A
        session's turn that ended without its KV kept is ended here (in a task: this may run in a cancelled
        handler)."""
        if self.handles.pop(handle.request_id, None) is not None:
            if handle.session and not turns.kept_by_worker(handle):
                self._in_background(turns.end(self, handle), f"end-turn-{handle.request_id}")
            finish_trace(handle)
            if handle.ended is not None:
                self.metrics.observe_end(handle.ended, handle.metrics or {}, handle.token_times, len(handle.token_ids))

    def abandon(self, handle: RequestHandle, reason: str) -> None:
        """The client left before the end: forget the handle now, and cancel the work in a task of its own.
        (Called from a handler being cancelled: an await there would be cancelled too, and the handle,
        its detokenizer and its spans would be kept for ever.)"""
        tp = getattr(handle.trace, "traceparent", "")
        self.release(handle)
        self._in_background(self.cancel(handle.request_id, reason, handle.reply_to, tp), f"cancel-{handle.request_id}")

    def _in_background(self, work, name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    run_in_background = _in_background  # for the APIs' packages (responses.takeover's followers)

    def add_loop(self, work, name: str) -> None:
        """A background loop of an API's package (responses.takeover's sweep): stopped with the core; /ready is 503
        while it has not completed a round lately (it calls loop_ok after each)."""
        self._tasks.append(asyncio.get_running_loop().create_task(work, name=name))

    def loop_ok(self, name: str) -> None:
        self._loop_ok[name] = time.monotonic()

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("%s failed: %r", task.get_name(), task.exception())

    async def cancel(self, request_id: str, reason: str, reply_to: str, traceparent: str = "") -> bool:
        """Settle CANCELLED (first terminal wins) and tell the scheduler to stop the work."""
        tp = traceparent or getattr(getattr(self.handles.get(request_id), "trace", None), "traceparent", "")
        publish = [
            Publish(reply_to, Cancelled(request_id=request_id, reason=reason, service="gateway", traceparent=tp)),
            Publish(self.names.control_stream, CancelRequested(request_id=request_id, reason=reason, traceparent=tp)),
        ]
        with active(self.handles.get(request_id)):
            res = await self.lifecycle.atransition(request_id, State.CANCELLED, reason, publish)
        return res.applied

    async def time_out(self, handle: RequestHandle) -> bool:
        """Backstop when no service reported the deadline: settle TIMED_OUT here. True when a terminal event
        is on its way to the handle (this one, or the one that settled it first); False when none will come
        (the context is gone, or Redis is away)."""
        tp = getattr(handle.trace, "traceparent", "")
        publish = [
            Publish(handle.reply_to, TimedOut(request_id=handle.request_id, service="gateway", traceparent=tp)),
            Publish(
                self.names.control_stream,
                CancelRequested(request_id=handle.request_id, reason="timeout", traceparent=tp),
            ),
        ]
        try:
            with active(handle):
                res = await self.lifecycle.atransition(handle.request_id, State.TIMED_OUT, "deadline", publish)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            logger.warning("cannot settle %s as timed out: %s", handle.request_id, e)
            return False
        return res.previous is not None

    def stalled_loops(self) -> list[str]:
        """Background loops that are not running, or have not completed a round lately."""
        now, limit = time.monotonic(), LOOP_STALE_S + self.s.heartbeat_interval_s
        stalled = [t.get_name() for t in self._tasks if t.done()]
        return stalled + [name for name, at in self._loop_ok.items() if now - at > limit and name not in stalled]

    async def ready(self, client=None) -> dict:
        """Live instances per service kind (raises Unavailable when this gateway is not ready). client: the
        request pool for an admission's check (the default), the ops pool for the /ready probe."""
        r = client or self.r
        if self.draining:
            raise Unavailable("the gateway is shutting down", None, "shutting_down")
        await r.ping()
        if stalled := self.stalled_loops():
            raise Unavailable(f"not ready: the gateway's {', '.join(stalled)} loop is not running", None, "not_ready")
        found = {}
        for service in BUS_SERVICES:
            found[service] = len(await liveness.aread_live(r, self.names, service))  # one HGETALL, no SCAN
        return found
