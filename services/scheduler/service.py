"""Scheduler service: queues preprocessed requests and places them on live workers with room.

Durability: a request's QUEUED transition and its copy in the `queue` hash are written before the preprocessed event
is acknowledged, so a restarted scheduler rebuilds its queue from Redis. Placement is one atomic script: SCHEDULED
transition + `scheduled` event on the worker's stream (on a Redis Cluster the event right after); a request
cancelled meanwhile is refused there and never reaches a worker. Its record follows (assignments.py); a placement
cut short before it is finished from what Redis holds (repair.py).
"""

from __future__ import annotations

import logging
import time
import uuid

import msgspec

from services.scheduler.assignments import Assignments
from services.scheduler.recovery import (
    QueueRecords,
    decode_queued,
    encode_queued,
    recover_lost,
    requeue_undelivered,
)
from services.scheduler.repair import HeldUnknown, PlacementSweep
from services.scheduler.deadlines import Costs, DeadlinePolicy, Work
from services.scheduler import batch, refusal
from services.scheduler.routing import READ_COUNT, Router
from services.scheduler.state import RequestQueue, WorkerView, blocks_needed
from services.scheduler.sync import ReplicaSync
from shared.process.liveness import GatewayWatch
from shared.process.service import BusService
from shared.process import telemetry
from shared.wire.block_hash import block_hashes
from shared.wire.bus import Delivery, event_field, plain_events
from shared.wire.constants import GROUP_SCHEDULER
from shared.wire.dispatch import TypeDispatcher
from shared.state.epoch import DatasetEpoch
from shared.wire.events import CancelRequested, Failed, HandBack, Heartbeat, Preprocessed, Reason, Scheduled, TimedOut
from shared.state.janitor import scheduler_janitor
from shared.state.lifecycle import Publish, State, TransitionResult
from shared.redis_io.redis_client import sync_client
from shared.process.runtime import Liveness, StopFlag, run_loop
from shared.settings import SchedulerSettings

logger = logging.getLogger(__name__)

OUTAGE_GAP_S = 2.0  # ticks this far apart mean the loop was backing off (Redis away): contact starts again
ON_A_WORKER = (State.SCHEDULED, State.PREFILLING, State.DECODING, State.PREEMPTED)


class SchedulerService(BusService):
    kind = "scheduler"

    def __init__(self, settings: SchedulerSettings):
        super().__init__(settings, on_dead=self._on_dead)
        self.queue = RequestQueue()
        # Names this process in the shared hashes' change streams (two processes given one instance id too).
        writer = f"{self.id}#{uuid.uuid4().hex[:6]}"
        self.assignments = Assignments(self.r, self.names, writer)
        self.records = QueueRecords(self.r, self.names, writer)
        self.replicas = ReplicaSync(self, writer)
        self.held = HeldUnknown(self, settings.placement_grace_s)
        self.gateways = GatewayWatch(settings.liveness_ttl_s)
        self.detached_checked: dict[str, bool] = {}  # orphans of dead gateways -> created detached (recovery.detached)
        self.workers: dict[str, WorkerView] = {}
        self.router = Router(settings)
        self.live = Liveness.of(settings, "scheduler", self.id)
        # Heartbeats are read by every replica (plain XREAD), the other streams shared through the group.
        self.streams = [
            *(self.names.preprocessed_stream(p) for p in self.names.all_partitions),
            self.names.control_stream,
        ]
        # Start with the heartbeats of the last TTL, so a restarted scheduler knows the workers at once.
        self.hb_cursor = f"{int((time.time() - settings.liveness_ttl_s) * 1000)}-0"
        # Off the tick (a thread and client of its own): under sustained load a sweep deletes thousands of ended
        # contexts, and neither it nor the stream trimming may delay placements, deadlines or cancels.
        # The placement repair's sweep too: it reads every partition's SCHEDULED requests.
        repair = PlacementSweep(sync_client(settings), self.names, f"{writer}/repair", settings)
        self.janitor_loop = scheduler_janitor(
            settings,
            self.names,
            self.id,
            [*(self.names.received_stream(p) for p in self.names.all_partitions), *self.streams],
            [repair.sweep],
        )
        self.epoch = DatasetEpoch(self.names)
        self.deadlines = DeadlinePolicy(settings.timeout_safety_factor, settings.timeout_min_s, settings.timeout_max_s)
        # Redis contact: after an outage every heartbeat looks old; no worker is judged lost until the
        # scheduler has been in contact for a whole liveness TTL again (their heartbeats resume within it).
        self._contact_since, self._last_tick = float("-inf"), time.monotonic()
        # Preprocessed requests are taken in together first (batch.intake); these one by one.
        self.handlers = TypeDispatcher({CancelRequested: self.on_cancel, HandBack: self.on_hand_back})

    def run(self) -> None:
        stop = StopFlag()
        self.ensure_groups()
        self.epoch.check(self.r)
        self.sync()
        logger.info("scheduler %s started, %d queued", self.id, len(self.queue))
        self.janitor_loop.start()
        try:
            run_loop(stop, self.tick, "scheduler", on_nogroup=self.ensure_groups)
        finally:
            self.janitor_loop.stop()
        self.live.clear(self.r)

    def ensure_groups(self) -> None:
        self.bus.ensure_groups(self.streams, GROUP_SCHEDULER)

    def tick(self) -> None:
        try:
            self._tick()
        except Exception:  # cut short: what this replica holds and what Redis holds may differ now
            self.replicas.full = True
            raise

    def _tick(self) -> None:
        """Read, dispatch, then act on time (deadlines, lost workers) and place what fits."""
        self._note_contact()
        deliveries = self.bus.read(self.streams, GROUP_SCHEDULER)
        self.read_heartbeats()  # before judging any worker lost: they may have just resumed
        if self.live.due():
            if self.epoch.check(self.r):
                self.forget_dataset()
            deliveries += self.bus.sweep_all(self.streams, GROUP_SCHEDULER)
            self.live.refresh(self.r, {"queued": len(self.queue)})
            self.sync()
            self.recover_lost()
            refusal.refuse_those_too_late(self)
        batch.intake(self, deliveries)
        self.expire_deadlines()
        self.place()
        self._last_tick = time.monotonic()

    def _note_contact(self) -> None:
        now = time.monotonic()
        if now - self._last_tick > OUTAGE_GAP_S:  # the last tick failed or Redis was away meanwhile
            self._contact_since = now

    def forget_dataset(self) -> None:
        """Redis lost its data: what this replica held in memory refers to requests that no longer exist."""
        logger.error(
            "dropping %d queued requests and %d placements of the lost dataset",
            len(self.queue),
            len(self.assignments.by_request),
        )
        self.queue = RequestQueue()
        self.assignments.by_request.clear()
        for w in self.workers.values():
            w.clear_inflight()
        self.replicas.full = True  # the change streams were lost with the rest
        self.ensure_groups()

    def dispatch(self, d: Delivery) -> None:
        if self.handlers.handles(d.event):
            self.handlers(d.event)
        else:
            logger.error("unexpected %s on %s", type(d.event).__name__, d.stream)

    def on_hand_back(self, ev: HandBack) -> None:
        if self.requeue(ev.scheduled, ev.output_token_ids, ev.reason):
            self.assignments.drop([ev.scheduled])

    def sync(self) -> None:
        """Align with what Redis holds: queued requests and placements are shared by every scheduler replica
        (a restarted or surviving one adopts those of a dead one); placement is compare-and-set, so two
        replicas holding one request never place it twice. Reads only what other replicas changed since the
        last sync (sync.py)."""
        self.replicas.sync()

    def after_queued(self, ev: Preprocessed, res: TransitionResult, client) -> None:
        """After the QUEUED transition (batch.intake): queue it here and store its record (through client, a
        pipeline); or adopt a redelivered request that is QUEUED already. Refused (a redelivery of a request placed
        since) or ended: nothing to do."""
        if res.applied:
            item = self.queue.push(ev)
            if item is not None and refusal.refuse_if_too_late(self, item):
                return
            if item is not None and ev.adaptive_deadline:
                self.set_adaptive_deadline(item, client)
            if item is not None:
                self.records.put(ev.request_id, encode_queued(item), None if client is self.r else client)
        elif res.previous == State.QUEUED:
            self.adopt_queued(ev)

    def adopt_queued(self, ev: Preprocessed) -> None:
        """A redelivered event of a QUEUED request: either a scheduler died between the transition and storing
        the queue record (finish its work, or the request would sit QUEUED for ever), or the request was
        requeued since (its stored record, with its attempt and tokens, is the truth: never this event)."""
        stored = self.records.get(ev.request_id)
        if stored is not None:
            rec = decode_queued(stored)
            self.push_record(rec)
            return
        item = self.queue.push(ev)
        if item is not None:
            self.records.put(ev.request_id, encode_queued(item), only_new=True)

    def push_record(self, rec) -> None:
        ahead = Work(*rec.ahead) if rec.ahead is not None else None
        self.queue.push(rec.event, rec.attempt, rec.output_token_ids, rec.deadline, ahead)

    def set_adaptive_deadline(self, item, client=None) -> None:
        """Fix the request's allowance in work (its own and what is queued ahead of it) and price it with the
        workers' latest costs; judged again with newer costs before it is ever timed out (deadlines.py)."""
        item.ahead = self.queue.work_ahead_of(item)
        self.judge_deadline(item, client=client)

    def judge_deadline(self, item, since: float | None = None, client=None) -> None:
        """Price the item's work (ahead of it, then its own) with the latest costs; its allowance runs from its
        arrival, or from `since` when it is extended."""
        costs = Costs.of([w.hb for w in self._live_views()])
        if costs is None or item.ahead is None:
            return  # nothing measured yet (or only workers known from stored placements): keep the cap
        predicted = costs.seconds(item.ahead, item.work())
        start = item.event.received_at if since is None else since
        item.deadline = self.deadlines.deadline(start, item.event.deadline, predicted)
        self.store.update(
            client or self.r, item.request_id, "meta", {"deadline": item.deadline, "predicted_s": predicted}
        )

    def extend_if_progressing(self, item, ahead_now: Work, now: float) -> bool:
        """Its allowance passed. While the queue ahead of it moves, or live workers are stepping (their step
        counters move: the hang timeout tells), it is progressing at the cluster's real rate, just slower than
        predicted: it gets a fresh allowance from now for the work left, priced with the latest costs. With
        neither (no live worker, or every one hung) its wait is a stall: it times out."""
        moved = (
            ahead_now.prefill_tokens + ahead_now.decode_tokens < item.ahead.prefill_tokens + item.ahead.decode_tokens
        )
        if not (moved or self._live_views()):
            return False
        item.ahead = ahead_now
        self.judge_deadline(item, since=now)
        return item.deadline > now

    def requeue(
        self, sch: Scheduled, output_token_ids: tuple[int, ...], reason: str, only_from: tuple[State, ...] = ON_A_WORKER
    ) -> bool:
        """Put a request that left its worker back in the queue; the next worker resumes after
        output_token_ids. Each move counts as an attempt; past max_attempts the request fails. Fenced by the
        placement's attempt: a redelivered hand-back, or a loss noticed twice, finds the request moved on
        (another attempt, or QUEUED already) and changes nothing. True when this call moved it."""
        fence = {"fence": sch.attempt, "only_from": only_from}
        if sch.attempt >= self.s.max_attempts:
            fail = Failed(
                request_id=sch.request_id,
                reason=Reason.WORKER_LOST,
                service="scheduler",
                message=f"the request lost its worker {sch.attempt} times ({reason}); giving up",
                traceparent=sch.traceparent,
            )
            return self._try(sch.request_id, State.FAILED, Reason.WORKER_LOST, [Publish(sch.reply_to, fail)], **fence)
        if not self._try(sch.request_id, State.QUEUED, reason, (), **fence):
            return False  # settled or moved on meanwhile
        bs = self.s.block_size  # what it resumes from is prompt + outputs: the blocks to match are theirs
        ev = Preprocessed(
            request_id=sch.request_id,
            reply_to=sch.reply_to,
            prompt_token_ids=sch.prompt_token_ids,
            sampling=sch.sampling,
            priority=sch.priority,
            deadline=sch.deadline,
            received_at=sch.received_at,
            traceparent=sch.traceparent,
            block_size=bs,
            block_hashes=block_hashes(sch.prompt_token_ids + output_token_ids, bs),
            group_id=sch.group_id,
            session=sch.session,  # placed anew by the KV index alone: the worker it had is the one it left
        )
        # Ahead of newer arrivals of its priority: it keeps its original arrival time.
        item = self.queue.push(ev, attempt=sch.attempt + 1, output_token_ids=output_token_ids, deadline=sch.deadline)
        if item is not None:
            self.records.put(sch.request_id, encode_queued(item))
        logger.info(
            "requeued %s (%s) with %d tokens done, attempt %d",
            sch.request_id,
            reason,
            len(output_token_ids),
            sch.attempt + 1,
        )
        return True

    def _try(self, request_id: str, to: State, reason: str, publish, **kw) -> bool:
        """A transition that may find the request elsewhere than the caller believed (another replica or a
        redelivery moved it): that is a no-op, never an error that would stop the scheduler."""
        res = self.lifecycle.transition(request_id, to, reason, publish, **kw)
        if res.refused:
            logger.info("request %s: not moved to %s, it is %s", request_id, to.value, res.previous.value)
        return res.applied

    def on_cancel(self, ev: CancelRequested) -> None:
        if self.queue.remove(ev.request_id) is not None:
            self.records.drop([ev.request_id])
        # Always ask Redis where it runs: this replica's copy may be stale (another replica placed it).
        worker = self.r.hget(self.names.layer(ev.request_id, "exec"), "worker_id")
        if worker:
            wid = msgspec.json.decode(worker)
            self.bus.publish(
                self.names.worker_stream(wid),
                msgspec.structs.replace(ev, worker_id=wid, traceparent=telemetry.current_traceparent(ev.traceparent)),
            )

    def read_heartbeats(self) -> None:
        """Heartbeats and the workers' KV events, in one XREAD; then ask any worker the KV index lost track of to
        announce its cache."""
        kv_stream, caught_up = self.names.kv_events_stream.encode(), True
        pipe = self.r.pipeline(transaction=False)  # two reads, not one XREAD: the streams' slots may differ
        pipe.xread({self.names.heartbeat_stream: self.hb_cursor}, count=READ_COUNT)
        pipe.xread({kv_stream: self.router.cursor}, count=READ_COUNT)
        for stream, entries in (x for reply in pipe.execute() for x in reply or []):
            if stream == kv_stream:
                self.router.on_entries(entries)
                caught_up = len(entries) < READ_COUNT
                continue
            for entry_id, ev in plain_events(entries, "heartbeat"):
                self.hb_cursor = entry_id
                if isinstance(ev, Heartbeat):
                    self.on_heartbeat(ev)
        for ask in self.router.resyncs(self.workers, caught_up):
            self.bus.publish(self.names.worker_stream(ask.worker_id), ask)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        view = self.workers.get(hb.worker_id)
        over = self.assignments.settle_with_heartbeat(hb.worker_id, hb.request_ids, hb.last_read_id)
        if over and self.names.cluster:  # on a single Redis a placement and its event are one atomic step
            requeue_undelivered(self, over)
        self.held.on_heartbeat(hb)  # what it holds that no placement names: its scheduler was cut short
        if view is None or view.hb is None:
            logger.info("worker %s joined (%d blocks, %d seqs)", hb.worker_id, hb.total_blocks, hb.max_num_seqs)
            self.workers[hb.worker_id] = WorkerView(hb.worker_id, hb, time.monotonic())
        else:
            view.observe(hb)

    def _on_dead(self, stream: str, event, why: str) -> None:
        """A poison entry: fail its request (if it names one) so its client gets an answer."""
        rid, reply_to = event_field(event, "request_id"), event_field(event, "reply_to")
        if not isinstance(rid, str) or not isinstance(reply_to, str):
            return
        self.queue.remove(rid)
        fail = Failed(
            request_id=rid,
            reason=Reason.INTERNAL,
            service="scheduler",
            message=f"the scheduler could not process this request ({why})",
        )
        res = self.lifecycle.transition(rid, State.FAILED, Reason.INTERNAL, [Publish(reply_to, fail)])
        if not res.applied:
            logger.error("cannot fail dead-lettered %s: %s", rid, res.status.value)

    def expire_deadlines(self) -> None:
        now = time.time()
        expired = self.queue.expired(now)
        ahead = self.queue.work_ahead() if any(q.ahead is not None for q in expired) else {}
        for q in expired:
            if q.ahead is not None and self.extend_if_progressing(q, ahead[q.request_id], now):
                continue
            self.queue.remove(q.request_id)
            self.records.drop([q.request_id])
            out = TimedOut(
                request_id=q.request_id, state=State.QUEUED, service="scheduler", traceparent=q.event.traceparent
            )
            self._try(
                q.request_id,
                State.TIMED_OUT,
                Reason.DEADLINE,
                [Publish(q.event.reply_to, out)],
                only_from=(State.QUEUED,),
            )

    def place(self) -> None:
        """Place queued requests in (priority, arrival) order while some live worker has room: up to PLACE_BATCH
        placements go out together (batch.send_all); their room is reserved as they are chosen."""
        live, picks = self._live_views(), []
        while live and (head := self.queue.peek()) is not None and len(picks) < batch.PLACE_BATCH:
            need = blocks_needed(len(head.event.prompt_token_ids) + len(head.output_token_ids), live[0].hb.block_size)
            fits = [w for w in live if w.free_slots(self.s.queue_slack) > 0]
            if not fits:
                break
            decision = self.router.choose(head, fits, need, live[0].hb.block_size)  # placement.py: the policy
            best, reserve = self.workers[decision.worker_id], decision.new_blocks(need)
            self.queue.pop()
            best.add_inflight(head.request_id, batch.RESERVED, reserve)
            picks.append(
                batch.Pick(head, best, reserve, decision, batch.pick_spans(self, head, best, fits, need, decision))
            )
        if picks:
            batch.send_all(self, picks)

    def _live_views(self) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.hb is not None and self._alive(w)]

    def _alive(self, w: WorkerView) -> bool:
        return w.alive(self.s.liveness_ttl_s, self.s.worker_hang_timeout_s)

    def recover_lost(self) -> None:
        """Move the requests of workers that stopped heartbeating; cancel those of gateways that died."""
        if time.monotonic() - self._contact_since >= self.s.liveness_ttl_s:  # else back from a Redis outage:
            recover_lost(self)  # liveness entries are old until their owners refresh them
