"""Worker service: reads its stream between engine steps, steps, publishes, heartbeats.

Requests join and leave the running batch at every step (continuous batching): new
`scheduled` events are read without blocking while the engine has work, and only block
(up to read_block_ms) when it is idle.
"""

from __future__ import annotations

import logging
import time
import uuid

from services.worker.engine.outputs import step_line
from services.worker.engine.warmup import warm_up
from services.worker.engine import (
    EngineRequest,
    RecoverableEngineError,
)
from services.worker.build import build_engine, sampling_options
from services.worker.heartbeat import Heartbeater
from services.worker.kv_events import KvEventPublisher
from services.worker.publisher import Active, StepPublisher
from services.worker.sessions import SessionRecorder
from services.worker.tracing import WorkerTracing
from shared.process.service import BusService
from shared.process import telemetry
from shared.wire.bus import Delivery
from shared.wire.constants import GROUP_WORKER
from shared.wire.dispatch import TypeDispatcher
from shared.state.epoch import DatasetEpoch
from shared.wire.events import (
    CancelRequested,
    Failed,
    HandBack,
    Heartbeat,
    KvResyncRequested,
    SessionClosed,
    SessionReason,
    Reason,
    Scheduled,
    TimedOut,
)
from shared.state.lifecycle import Publish, State
from shared.process.runtime import Liveness, StopFlag, run_loop
from shared.state.sessions import SessionStore
from shared.settings import WorkerSettings

logger = logging.getLogger(__name__)


class WorkerService(BusService):
    kind = "worker"

    def __init__(self, settings: WorkerSettings):
        super().__init__(settings)
        self.stream = self.names.worker_stream(self.id)
        self.engine = build_engine(settings, self.swap_dir(settings))
        self.sessions = SessionRecorder(SessionStore(self.r, self.names, settings.session_ttl_s, "worker"), self.id)
        self.publisher = StepPublisher(self.r, self.names, self.id, self.lifecycle, self.store, settings.context_ttl_s)
        self.active: dict[str, Active] = {}
        self.tracing = WorkerTracing(self.engine)
        self.kv_events = KvEventPublisher(self.bus, self.id, self.engine, settings.block_size)
        self.beats = Heartbeater(self.r, Liveness.of(settings, "worker", self.id))
        self.last_read_id = ""
        self._cut_short = True  # entries may be pending from a previous life under this id: taken up at start
        self.step_no = 0
        self.draining = False
        self.step_time_avg = 0.0
        self.epoch = DatasetEpoch(self.names)
        self._epoch_checked = 0.0
        self.handlers = TypeDispatcher(
            {
                Scheduled: self.admit,
                CancelRequested: self.on_cancel,
                KvResyncRequested: lambda _ev: self.kv_events.announce(),
                SessionClosed: lambda ev: self.engine.close_session(ev.session),
            }
        )

    def swap_dir(self, s: WorkerSettings) -> str:
        """A folder of this process's own (the tier empties it at start); by default a new one under
        <cache_dir>/kv-swap each start, the folders of processes that died removed first."""
        if not s.session_swap:
            return ""
        if s.session_swap_dir:
            return s.session_swap_dir
        from services.worker.engine.kv.kv_tier import remove_abandoned  # numpy only; not for a worker without a tier

        parent = s.cache_dir / "kv-swap"
        remove_abandoned(parent)
        return str(parent / f"{self.id}-{uuid.uuid4().hex[:8]}")

    def warm_up(self) -> None:
        """Every step shape a first round meets, run once before taking work (engine/warmup.py): the first call
        of a shape pays one-off costs that would otherwise land on the first clients. The simulated engine has
        none to pay."""
        if self.s.engine == "torch":
            warm_up(self.engine, self.s.warmup_budget_s)

    def run(self) -> None:
        stop = StopFlag()
        self.warm_up()
        self.bus.ensure_group(self.stream, GROUP_WORKER)
        self.kv_events.start()
        self.epoch.check(self.r)
        self.snapshot()
        self.beats.start()
        logger.info("worker %s ready on %s (%s)", self.id, self.stream, self.engine.stats())
        run_loop(stop, self.tick, "worker", on_nogroup=lambda: self.bus.ensure_group(self.stream, GROUP_WORKER))
        self.drain()

    def tick(self) -> None:
        """Read what arrived (without blocking while there is work), step, publish, heartbeat."""
        self.housekeeping()
        busy = self.engine.has_unfinished()
        # Its stream's pending entries are claimed by no one: after a Redis error cut a dispatch short (run_loop
        # backs off and comes back here), what that read and did not acknowledge is taken up again first.
        taken_up = self.taken_up(self.bus.read_own_pending(self.stream, GROUP_WORKER)) if self._cut_short else []
        deliveries = taken_up + self.bus.read([self.stream], GROUP_WORKER, block_ms=0 if busy else None)
        self._cut_short = True
        self.bus.process_all(deliveries, self.dispatch)
        self._cut_short = False
        self.expire_deadlines()
        if self.engine.has_unfinished():
            self.step()
        self.kv_events.publish_changes()
        self.snapshot()

    def taken_up(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Of the unacknowledged entries read again, those still to do. A placement admitted before the error is
        not started twice: one running is in self.active (admit skips it); one since ended, or moved on to another
        attempt, no longer waits SCHEDULED at its attempt, and is only acknowledged. Cancels are idempotent."""
        placements = [d for d in deliveries if isinstance(d.event, Scheduled) and d.event.request_id not in self.active]
        if not placements:
            return deliveries
        pipe = self.r.pipeline(transaction=False)
        for d in placements:
            pipe.hget(self.names.layer(d.event.request_id, "meta"), "state")
            pipe.hget(self.names.layer(d.event.request_id, "exec"), "attempt")
        found = pipe.execute()
        done = {
            d.entry_id
            for d, st, at in zip(placements, found[::2], found[1::2])
            if st != State.SCHEDULED.value.encode() or at != str(d.event.attempt).encode()
        }
        self.bus.ack_all([d for d in deliveries if d.entry_id in done])
        return [d for d in deliveries if d.entry_id not in done]

    def dispatch(self, d: Delivery) -> None:
        self.last_read_id = d.entry_id
        if self.handlers.handles(d.event):
            self.handlers(d.event)
        else:
            logger.error("unexpected %s on %s", type(d.event).__name__, d.stream)
        # Acknowledged once the engine holds it; a lost worker's requests are recovered by the scheduler.

    def admit(self, ev: Scheduled) -> None:
        if ev.request_id in self.active:
            return  # redelivered
        if self.draining:
            self.hand_back(ev, list(ev.output_token_ids), Reason.SHUTDOWN)
            return
        try:
            self.engine.add_request(
                EngineRequest(
                    request_id=ev.request_id,
                    prompt_token_ids=list(ev.prompt_token_ids),
                    sampling=sampling_options(ev.sampling),
                    priority=ev.priority,
                    output_token_ids=list(ev.output_token_ids),
                    group_id=ev.group_id,
                    session_id=ev.session,
                )
            )
        except RecoverableEngineError as e:  # this request alone is at fault
            logger.warning("refusing %s: %s", ev.request_id, e)
            self.fail(ev, f"the worker refused it: {e}")
            return
        except Exception as e:
            # Any other exception starting it (llguidance failing on a first constrained request, a bug): failed
            # now, not left pending. Nothing ever re-reads this stream's pending entries (this worker is its only
            # reader), so the request sat SCHEDULED until its cap; and placing it again would meet the same
            # exception on every worker of this build, MAX_ATTEMPTS times, before a misleading worker_lost.
            logger.exception("admitting %s failed; failing it", ev.request_id)
            self.engine.abort_request(ev.request_id)  # whatever part of it the engine took
            self.fail(ev, f"the worker could not start it ({type(e).__name__}: {str(e)[:200]})")
            return
        self.active[ev.request_id] = Active(
            ev.request_id,
            ev.reply_to,
            telemetry.current_traceparent(ev.traceparent),
            len(ev.prompt_token_ids),
            ev.deadline,
            list(ev.output_token_ids),
            scheduled=ev,
            attempt=ev.attempt,
            session=ev.session,
        )

    def fail(self, ev: Scheduled, message: str) -> None:
        """Settle a placement this worker cannot run as FAILED (worker_error), telling its client; fenced by its
        attempt, so a placement that has moved on is left alone."""
        fail = Failed(
            request_id=ev.request_id,
            reason=Reason.WORKER_ERROR,
            message=message,
            service="worker",
            traceparent=ev.traceparent,
        )
        self.lifecycle.transition(
            ev.request_id, State.FAILED, Reason.WORKER_ERROR, [Publish(ev.reply_to, fail)], fence=ev.attempt
        )

    def hand_back(self, ev: Scheduled, output_token_ids: list[int], reason: str) -> None:
        """Give a request back to the scheduler, which places it again; the next worker resumes after
        output_token_ids, so the client sees no gap and no repeat."""
        out = HandBack(
            request_id=ev.request_id,
            worker_id=self.id,
            reason=reason,
            scheduled=ev,
            output_token_ids=tuple(output_token_ids),
            traceparent=ev.traceparent,
        )
        self.bus.publish(self.names.control_stream, out)

    def step(self) -> None:
        t_start_ns = time.time_ns()
        result = self.engine.step(
            on_scheduled=lambda t: self.publisher.publish_scheduled(self.tracing.scheduled(t), self.active)
        )
        self.step_no += 1
        self.step_time_avg = (
            0.9 * self.step_time_avg + 0.1 * result.step_time_s if self.step_no > 1 else result.step_time_s
        )
        # Before the completions: a client's next turn finds its session paused (and placed here).
        for session in self.sessions.paused(result.outputs, self.active):
            self.engine.close_session(session)
        moved = self.publisher.publish(self.step_no, result, self.active, self.engine.request_kv_info)
        self.sessions.moved(self.engine.take_session_events())
        self.tracing.on_step(result, self.active, t_start_ns, time.time_ns())
        if logger.isEnabledFor(logging.DEBUG):  # CONVEYOR_LOG_LEVEL=DEBUG: one line a step, for profiling a run
            logger.debug(step_line(self.step_no, result, self.engine.stats(), (time.time_ns() - t_start_ns) / 1e9))
        for out in result.outputs:
            if out.finished:
                self.active.pop(out.request_id, None)
        for rid in moved:  # placed elsewhere while this worker was away: not ours to finish
            self.drop(rid, Reason.MOVED)

    def on_cancel(self, ev: CancelRequested) -> None:
        self.drop(ev.request_id, ev.reason)

    def drop(self, request_id: str, why: str) -> None:
        """Stop a request here and forget it (cancelled, moved to another worker, or its data is gone)."""
        if self.active.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self.tracing.abort(request_id, why)

    def housekeeping(self) -> None:
        """Once per heartbeat interval: drop the entries of its stream it has handled (it is their only reader),
        and if Redis lost its data, drop the requests whose context went with it (their gateways answer their
        clients), freeing their blocks."""
        now = time.monotonic()
        if now - self._epoch_checked < self.s.heartbeat_interval_s:
            return
        self._epoch_checked = now
        self.engine.expire_sessions(self.s.session_idle_ttl_s)
        self.sessions.moved(self.engine.take_session_events())
        if self.last_read_id:
            self.r.xtrim(self.stream, minid=self.last_read_id, approximate=True)
        if self.epoch.check(self.r):
            # Only those whose context is gone: a request placed here since the loss belongs to the new dataset.
            lost = self.publisher.not_owned(self.r, list(self.active), self.active)
            logger.error("dropping %d of %d requests: the lost dataset's", len(lost), len(self.active))
            for rid in lost:
                self.drop(rid, Reason.STATE_LOST)
            self.bus.ensure_group(self.stream, GROUP_WORKER)

    def expire_deadlines(self) -> None:
        now = time.time()
        for a in [a for a in self.active.values() if a.deadline <= now]:
            self.engine.abort_request(a.request_id)
            del self.active[a.request_id]
            self.tracing.abort(a.request_id, Reason.TIMEOUT)
            ev = TimedOut(request_id=a.request_id, state=a.state, service="worker", traceparent=a.traceparent)
            self.lifecycle.transition(
                a.request_id, State.TIMED_OUT, Reason.DEADLINE, [Publish(a.reply_to, ev)], fence=a.attempt
            )

    def snapshot(self) -> None:
        """Hand the heartbeat thread the current figures."""
        st = self.engine.stats()
        self.beats.update(
            Heartbeat(
                worker_id=self.id,
                sent_at=time.time(),
                max_num_seqs=st.max_num_seqs,
                draining=self.draining,
                num_running=st.num_running,
                num_waiting=st.num_waiting,
                request_ids=tuple(self.active),
                last_read_id=self.last_read_id,
                total_blocks=st.total_blocks,
                free_blocks=st.free_blocks,
                cached_blocks=st.cached_blocks,
                block_size=st.block_size,
                step_time_s=self.step_time_avg,
                prefill_s_per_token=st.prefill_s_per_token,
                decode_s_per_token=st.decode_s_per_token,
                num_preemptions=st.num_preemptions,
                prefix_cache_queries=st.prefix_cache_queries,
                prefix_cache_hits=st.prefix_cache_hits,
                step_no=self.step_no,
                busy=bool(self.active),
                kv_incarnation=self.kv_events.incarnation,
                kv_seq=self.kv_events.seq,
                decode_tokens_left=st.decode_tokens_left,
                num_drafted=st.num_drafted,
                num_draft_accepted=st.num_draft_accepted,
                **st.sessions,
            )
        )

    def drain(self) -> None:
        """On SIGTERM: take no new work (a heartbeat with no room; anything still arriving is handed back),
        finish what is held within drain_timeout_s, then hand the rest back to be resumed elsewhere."""
        self.draining = True
        self.snapshot()
        self.beats.beat()
        deadline = time.monotonic() + self.s.drain_timeout_s
        logger.info("worker %s draining %d requests", self.id, len(self.active))
        while time.monotonic() < deadline:
            self.bus.process_all(self.bus.read([self.stream], GROUP_WORKER, block_ms=0), self.dispatch)
            if not self.engine.has_unfinished():
                break
            self.step()
            self.expire_deadlines()
        for a in list(self.active.values()):
            self.engine.abort_request(a.request_id)
            self.tracing.abort(a.request_id, Reason.SHUTDOWN, error=False)
            self.hand_back(a.scheduled, a.output_token_ids, Reason.SHUTDOWN)
        self.active.clear()
        self.engine.expire_sessions(0.0, SessionReason.WORKER_RESTART)
        self.sessions.moved(self.engine.take_session_events())
        self.kv_events.clear()
        self.beats.stop()
