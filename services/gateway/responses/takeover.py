"""A background response whose gateway died is taken over by another: it completes as if nothing had happened.

Its request is detached (meta `detached`, set at its creation): the scheduler does not cancel it with its dead
gateway's other requests, so the worker goes on generating into its tokens list and context, whoever listens. A
gateway's sweep finds the response running under a gateway that is not live: every heartbeat interval it reads the
driving index (store.driving_gateways: one range read per gateway, at most MAX_GATEWAYS; then at most MAX_PER_SWEEP
entries per dead one: missing from the liveness hash for a TTL, as the scheduler judges it), in a loop of its own off every request's path (a GET, or a replay of the events, only reads
the record: it sees the response go on once taken over). It claims it (store.claim: one Lua step, fenced, so exactly one gateway wins
and the dead one's writes, should it come back, are refused) and then drives it as its own background job:

- its output is planned again from the request's body kept in the record (the same tools, the same schema);
- a handle is made on the request as its context holds it (stop strings, deadline), registered with this gateway,
  and fed from the request's tokens list and state by a follower (session.reconcile.catch_up, every FOLLOW_POLL_S:
  the request's reply stream is the dead gateway's, which nobody reads);
- its event log goes on from its last sequence_number: the builder is fed the text the dead driver's had been fed
  (the log's entries note it) without logging it again, and its items keep the ids the stream announced.

Only a response whose request is gone (its context expired or lost) is settled failed (`gateway_lost`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import redis

from services.gateway.edge.errors import NotFound
from services.gateway.openai.structured_output import plan_chat, plan_weight
from services.gateway.responses import background, store
from services.gateway.responses.chat_body import chat_request, renamed
from services.gateway.responses.items import chat_turns
from services.gateway.responses.output import ECHOED, Envelope, OutputBuilder
from services.gateway.responses.schemas import ResponsesRequest
from services.gateway.session.handle import RequestHandle
from services.gateway.session.reconcile import catch_up
from services.gateway.session.tracing import untraced
from services.gateway.text.render import off_loop
from services.gateway.text.stop_strings import TextStream
from shared.process.liveness import GatewayWatch, aread_live

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore
    from shared.state.context_store import Snapshot

logger = logging.getLogger(__name__)

MAX_GATEWAYS = 64  # gateways a sweep looks at, at most
MAX_PER_SWEEP = 64  # responses of one dead gateway a sweep takes over, at most (the next sweep takes more)
FOLLOW_POLL_S = 0.1  # how often a taken-over request's tokens and state are read


async def take_over(core: GatewayCore, owner: str, stored: store.Stored) -> store.Stored:
    """Claim it from its dead driver and drive it here; what the record is now."""
    rid = stored.response["id"]
    await store.index_driving(core, owner, rid)  # before the claim: dying right after it leaves an entry to find
    fence = await store.claim(core, owner, stored)
    await store.unindex(core, stored.gateway, owner, rid)  # the dead driver's entry goes, whoever won
    if fence is None:  # it ended, or another gateway took it first (with an entry of its own)
        await store.unindex(core, core.id, owner, rid)
        return await store.get(core, owner, rid)
    claimed = replace(stored, gateway=core.id, fence=fence)
    snap = await core.store.aread(core.r, stored.request_id)
    if snap is None or snap.state is None or stored.body is None:
        return await _lost(core, owner, claimed, stored.gateway)
    logger.warning("response %s: its gateway %s is gone; taken over (fence %d)", rid, stored.gateway, fence)
    try:
        job = await _job(core, owner, claimed, snap)
    except Exception:  # claimed, and nobody else will try: it must not stay running until its TTL
        logger.exception("response %s: cannot be driven here", rid)
        return await _lost(core, owner, claimed, stored.gateway)
    core.handles[job.handle.request_id] = job.handle  # registered once its job could be made: never left behind
    background.spawn(job)
    _follow(core, job.handle)
    return claimed


async def _lost(core: GatewayCore, owner: str, claimed: store.Stored, dead: str) -> store.Stored:
    """Its request is gone too: nothing can finish it. Settled failed (send it again)."""
    rid = claimed.response["id"]
    error = {"code": "gateway_lost", "message": "the gateway driving this response stopped and its request is gone"}
    lost = claimed.with_response(claimed.response | {"status": "failed", "error": error})
    await store.update_running(core, owner, lost, claimed.fence)
    await store.unindex(core, core.id, owner, rid)
    logger.warning("response %s: its gateway %s is gone and its request too; settled failed", rid, dead)
    return await store.get(core, owner, rid)


async def _job(core: GatewayCore, owner: str, claimed: store.Stored, snap: Snapshot) -> background.Job:
    """The background job that drives it on from here, continuing its event log."""
    body = ResponsesRequest.model_validate(claimed.body)
    before = claimed.turns  # while it runs, its conversation ends with its input (no output stored yet)
    chat = chat_request(body, before, claimed.session_id or None)
    plan = await off_loop(lambda: plan_chat(chat), plan_weight(chat))
    r = claimed.response
    envelope = Envelope(r["id"], r["model"], {k: r.get(k) for k in ECHOED}, True, r["created_at"])
    job = background.Job(
        core,
        None,
        _handle(core, claimed, snap),
        envelope,
        OutputBuilder(plan),
        lambda response: claimed.with_response(response, before + chat_turns(response["output"])),
        owner,
        bool(body.stream),
        renamed,
        fence=claimed.fence,
        started=r["status"] == "in_progress",
    )
    if job.streamed:
        logged = await store.read_log(core, owner, r["id"])
        job.next_seq = logged[-1][1]["sequence_number"] + 1 if logged else 0
        job.skip = logged[-1][0] if logged else 0
        job.started = any(event["type"] == "response.in_progress" for _f, event in logged)
        added = [e["item"] for _f, e in logged if e["type"] == "response.output_item.added"]
        job.ids = [(item["id"], item.get("call_id")) for item in added]
    return job


def _handle(core: GatewayCore, claimed: store.Stored, snap: Snapshot) -> RequestHandle:
    """A handle on the request as its context holds it (its output reaches it by the follower)."""
    meta, inp = snap.layers.get("meta", {}), snap.layers.get("input", {})
    rid = claimed.request_id
    stops = list(inp.get("stop") or [])
    t0 = time.perf_counter()
    handle = RequestHandle(rid, claimed.reply_to, TextStream(core.tokenizer, stops), float(meta["deadline"]), t0)
    handle.trace = untraced(str(meta.get("traceparent") or ""), t0)
    handle.epoch = core.epoch.known
    handle.created()
    return handle


def _follow(core: GatewayCore, handle: RequestHandle) -> None:
    core.run_in_background(_follower(core, handle), f"follow-{handle.request_id}")


async def _follower(core: GatewayCore, handle: RequestHandle) -> None:
    """Deliver the request's output to the handle from its context, until it ended or the handle was released."""
    while handle.ended is None and core.handles.get(handle.request_id) is handle:
        try:
            if await catch_up(core, handle):
                return
        except redis.RedisError as e:
            logger.warning("request %s: reading its output failed (%r); retrying", handle.request_id, e)
        await asyncio.sleep(FOLLOW_POLL_S)


async def sweep(core: GatewayCore, watch: GatewayWatch) -> int:
    """Take over the running background responses of dead gateways (bounded, see the module's doc); how many. A
    gateway is dead once its liveness entry has been missing for a TTL as this sweep sees it (watch)."""
    live = set(await aread_live(core.r, core.names, "gateway"))
    gateways = await store.driving_gateways(core, MAX_GATEWAYS)
    taken = 0
    for gateway in watch.dead(live, set(gateways)):
        for owner, rid in await store.driven_by(core, gateway, MAX_PER_SWEEP):
            try:
                stored = await store.get(core, owner, rid)
            except NotFound:  # deleted or expired: its entry goes
                await store.unindex(core, gateway, owner, rid)
                continue
            if stored.gateway != gateway or stored.response["status"] not in store.RUNNING:
                await store.unindex(core, gateway, owner, rid)  # a stale entry: ended, or taken over already
                continue
            taken += (await take_over(core, owner, stored)).gateway == core.id
    return taken


async def sweep_loop(core: GatewayCore) -> None:
    """sweep every heartbeat interval, for ever: no error ends it."""
    watch = GatewayWatch(core.s.liveness_ttl_s)
    while True:
        try:
            await sweep(core, watch)
            core.loop_ok("responses-takeover")
        except redis.RedisError as e:
            logger.warning("takeover sweep failed: %r", e)
        except Exception:  # noqa: BLE001 - the loop must outlive anything
            logger.exception("takeover sweep failed unexpectedly")
        await asyncio.sleep(core.s.heartbeat_interval_s)
