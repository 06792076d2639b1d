"""The gateway's link to the bus: submit requests, route replies to their handles, cancel.

One reply stream per gateway process; a single reader task drains it and hands each event
to the request's handle. Entries are acknowledged once handed over: their only consumer
is this process, which holds the client connections they are for.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis

from services.gateway.admission import Admission
from services.gateway.errors import Unavailable
from services.gateway.handle import RequestHandle
from services.gateway.metrics import GatewayMetrics
from services.gateway.schemas import GenerateRequest
from services.gateway.stop_strings import TextStream
from services.gateway.tracing import active, finish_trace, published, refused, reply_processed, start_trace
from shared.constants import EVENT_FIELD, GROUP_GATEWAY, Names
from shared.context_store import ContextStore
from shared.errors import InvalidTransition
from shared.events import (CancelRequested, Cancelled, ChatMessage, RequestReceived, Sampling, SchemaError, TimedOut,
                           TokenGenerated, decode)
from shared.lifecycle import Lifecycle, Publish, State
from shared.runtime import instance_id
from shared.settings import GatewaySettings

logger = logging.getLogger(__name__)


class GatewayCore:
    def __init__(self, settings: GatewaySettings, client, tokenizer, model_name: str):
        self.s = settings
        self.r = client
        self.names = Names(settings.namespace)
        self.id = instance_id(settings, "gateway")
        self.reply_to = self.names.reply_stream(self.id)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.lifecycle = Lifecycle(client, self.names, "gateway", settings.context_ttl_s)
        self.store = ContextStore(client, self.names, int(settings.request_timeout_s) + settings.context_ttl_s)
        self.handles: dict[str, RequestHandle] = {}
        self.metrics = GatewayMetrics()
        self.draining = False  # set on SIGTERM: no new requests, /ready says 503
        self.admission = Admission(self)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        try:
            await self.r.xgroup_create(self.reply_to, GROUP_GATEWAY, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._tasks = [asyncio.create_task(self._read_replies(), name="replies"),
                       asyncio.create_task(self._keep_alive(), name="liveness")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        _done, pending = await asyncio.wait(self._tasks, timeout=5.0)
        if pending:  # a task that ignores cancellation must not hold the process up
            logger.error("background tasks did not stop: %s", [t.get_name() for t in pending])
        try:
            async with asyncio.timeout(5.0):
                await self.r.delete(self.names.live("gateway", self.id))
        except (redis.ConnectionError, redis.TimeoutError, TimeoutError) as e:
            logger.warning("could not remove the liveness key (it expires by itself): %r", e)
        logger.info("gateway core stopped")

    async def submit(self, req: GenerateRequest, max_tokens: int, traceparent: str = "", owner: str = "",
                     extra_meta: dict | None = None, route: str = "/generate") -> RequestHandle:
        """Create the request (or raise Overloaded/Unavailable); owner: the caller's API key id."""
        if self.draining:
            raise Unavailable("the gateway is shutting down; retry on another", None, "shutting_down",
                              headers={"Retry-After": "1"})
        rid = uuid.uuid4().hex  # 128 random bits
        t0, now = time.perf_counter(), time.time()
        timeout = req.timeout or self.s.request_timeout_s
        sampling = Sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k),
                            min_p=req.min_p, repetition_penalty=req.repetition_penalty, seed=req.seed,
                            min_tokens=req.min_tokens, stop_token_ids=tuple(req.stop_token_ids),
                            ignore_eos=req.ignore_eos)
        messages = tuple(ChatMessage(m.role, m.content) for m in req.messages) if req.messages else None
        rt = start_trace(rid, req, sampling, self.model_name, route, traceparent, t0)  # honours the client's
        ev = RequestReceived(request_id=rid, reply_to=self.reply_to, prompt=req.prompt, messages=messages,
                             sampling=sampling, priority=req.priority, deadline=now + timeout,
                             adaptive_deadline=req.timeout is None, received_at=now, traceparent=rt.publish_tp)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        handle = RequestHandle(rid, self.reply_to, TextStream(self.tokenizer, stops), now + timeout, t0)
        handle.trace = rt
        self.handles[rid] = handle  # before publishing: the first reply may come back at once
        meta = {"model": self.model_name, "priority": req.priority, "deadline": now + timeout,
                "timeout": req.timeout, "deadline_source": "adaptive" if req.timeout is None else "client",
                "reply_to": self.reply_to, "gateway": self.id, "stream": req.stream, "traceparent": rt.traceparent,
                "owner": owner, **(extra_meta or {})}
        input_ = {"prompt": req.prompt, "messages": [m.model_dump() for m in req.messages] if req.messages else None,
                  "sampling": {k: getattr(sampling, k) for k in sampling.__struct_fields__}, "stop": stops}
        try:
            await self.admission.create(rid, meta, input_, self.names.received_stream, ev)
        except BaseException as e:
            self.handles.pop(rid, None)
            refused(rt, e)
            raise
        published(rt, rid, self.names.received_stream)
        return handle

    def release(self, handle: RequestHandle) -> None:
        """Forget a request whose client has its answer (or left); its Prometheus figures move here, once."""
        if self.handles.pop(handle.request_id, None) is not None:
            finish_trace(handle)
            if handle.ended is not None:
                self.metrics.observe_end(handle.ended, handle.metrics or {}, handle.token_times,
                                         len(handle.token_ids))

    async def cancel(self, request_id: str, reason: str, reply_to: str) -> bool:
        """Settle CANCELLED (first terminal wins) and tell the scheduler to stop the work."""
        tp = getattr(getattr(self.handles.get(request_id), "trace", None), "traceparent", "")
        publish = [Publish(reply_to, Cancelled(request_id=request_id, reason=reason, service="gateway",
                                               traceparent=tp)),
                   Publish(self.names.control_stream, CancelRequested(request_id=request_id, reason=reason,
                                                                      traceparent=tp))]
        try:
            with active(self.handles.get(request_id)):
                res = await self.lifecycle.atransition(request_id, State.CANCELLED, reason, publish)
        except InvalidTransition:
            return False
        return res.applied

    async def time_out(self, handle: RequestHandle) -> bool:
        """Backstop when no service reported the deadline: settle TIMED_OUT here. True when a terminal event
        is on its way to the handle (this one, or the one that settled it first); False when none will come
        (the context is gone, or Redis is away)."""
        tp = getattr(handle.trace, "traceparent", "")
        publish = [Publish(handle.reply_to, TimedOut(request_id=handle.request_id, where="gateway",
                                                     service="gateway", traceparent=tp)),
                   Publish(self.names.control_stream, CancelRequested(request_id=handle.request_id, reason="timeout",
                                                                      traceparent=tp))]
        try:
            with active(handle):
                res = await self.lifecycle.atransition(handle.request_id, State.TIMED_OUT, "deadline", publish)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            logger.warning("cannot settle %s as timed out: %s", handle.request_id, e)
            return False
        return res.previous is not None

    async def _read_replies(self) -> None:
        while True:
            try:
                reply = await self.r.xreadgroup(GROUP_GATEWAY, self.id, {self.reply_to: ">"}, count=256,
                                                block=self.s.read_block_ms)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                logger.warning("reply stream read failed (%s); retrying", e)
                await asyncio.sleep(0.5)
                continue
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    self._route(fields, entry_id)
                if entries:
                    await self.r.xack(self.reply_to, GROUP_GATEWAY, *[e[0] for e in entries])

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
        elif (h := self.handles.get(getattr(ev, "request_id", ""))) is not None:
            reply_processed(h, ev, self.reply_to, GROUP_GATEWAY, self.id, entry_id)
            h.deliver(ev)

    async def _keep_alive(self) -> None:
        key = self.names.live("gateway", self.id)
        while True:
            try:
                await self.r.set(key, str(time.time()), px=int(self.s.liveness_ttl_s * 1000))
            except (redis.ConnectionError, redis.TimeoutError) as e:
                logger.warning("liveness refresh failed: %s", e)
            await asyncio.sleep(self.s.heartbeat_interval_s)

    async def ready(self) -> dict:
        if self.draining:
            raise Unavailable("the gateway is shutting down", None, "shutting_down")
        await self.r.ping()
        found = {}
        for service in ("tokenizer", "scheduler", "worker"):
            keys = [k async for k in self.r.scan_iter(match=self.names.live_pattern(service), count=100)]
            found[service] = len(keys)
        return found
