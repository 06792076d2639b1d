"""The scheduler's spans: `schedule` (the worker choice, with every candidate's score and matched blocks) and `queue`
(from the QUEUED transition to the SCHEDULED one, both at Redis's time, so its duration is the
request's queue_wait exactly)."""

from __future__ import annotations

from opentelemetry.trace import INVALID_SPAN, Span

from shared.process import telemetry


def start_schedule_span(q, best, candidates, need_blocks: int, decision) -> Span:
    """The `schedule` span of one placement, started (not current): it stays open until the placement is sent
    with the others of its tick (batch.send_all ends it)."""
    if not telemetry.enabled():
        return INVALID_SPAN
    ctx = telemetry.context_from(q.event.traceparent)
    span = telemetry.tracer().start_span("schedule", context=ctx, record_exception=False)
    if span.is_recording():
        span.set_attributes(
            {
                "conveyor.request_id": q.request_id,
                "conveyor.worker_id": best.worker_id,
                "conveyor.attempt": q.attempt,
                "conveyor.schedule.blocks_needed": need_blocks,
                "conveyor.schedule.candidates": [w.worker_id for w in candidates],
                "conveyor.schedule.scores": [float(w.score()) for w in candidates],
                "conveyor.schedule.free_blocks": [int(w.free_blocks()) for w in candidates],
                "conveyor.schedule.free_slots": [int(w.free_slots(0)) for w in candidates],
                # The routing decision (placement.py): mode, why, and each candidate's matched prompt blocks.
                "conveyor.schedule.routing": decision.mode,
                "conveyor.schedule.routing_reason": decision.reason,
                "conveyor.schedule.prompt_blocks": decision.prompt_blocks,
                "conveyor.schedule.matched_blocks": [int(decision.matched.get(w.worker_id, 0)) for w in candidates],
            }
        )
    return span


def queue_span(q, queued_at_raw, res) -> None:
    """The pass through QUEUED that just ended (res: the SCHEDULED transition's result)."""
    if queued_at_raw is None or res is None or not res.applied or not telemetry.enabled():
        return
    start = float(queued_at_raw.decode() if isinstance(queued_at_raw, bytes) else queued_at_raw)
    span = telemetry.tracer().start_span(
        "queue",
        context=telemetry.context_from(q.event.traceparent),
        start_time=int(start * 1e9),
        attributes={
            "conveyor.request_id": q.request_id,
            "conveyor.priority": q.event.priority,
            "conveyor.attempt": q.attempt,
        },
    )
    span.end(end_time=int(res.at * 1e9))
