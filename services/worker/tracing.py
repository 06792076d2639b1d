"""The worker's spans per request: `prefill` (an event per chunk, prompt and cached tokens) and `decode`
(output tokens, preemptions), timed by the engine steps (step start / step end, this process's clock).

Both are children of the request's `process` span on the worker (its traceparent is the Active's).
Nothing here runs when tracing is off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry.trace import Span

from services.worker.engine.protocol import Engine
from shared.process import telemetry
from shared.wire.events import State


@dataclass
class _Spans:
    prefill: Span | None = None
    decode: Span | None = None
    preemptions: int = 0


class WorkerTracing:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.spans: dict[str, _Spans] = {}
        self._scheduled: list[tuple[str, State]] = []  # this step's scheduling decisions (before its forward pass)

    def scheduled(self, transitions: list[tuple[str, State]]) -> list[tuple[str, State]]:
        """The engine's on_scheduled decisions (PREFILLING, PREEMPTED), kept for on_step; passed through."""
        if telemetry.enabled():
            self._scheduled = list(transitions)
        return transitions

    def on_step(self, result, active: dict, t_start_ns: int, t_end_ns: int) -> None:
        """After a step was published (before finished requests leave `active`)."""
        if not telemetry.enabled():
            return
        transitions, self._scheduled = self._scheduled + list(result.transitions), []
        for rid, status in transitions:
            if status is State.PREFILLING and rid in active:
                self._prefilling(active[rid], t_start_ns)
        self._chunks(t_end_ns)
        for rid, status in transitions:
            if status is not State.PREFILLING and rid in active:
                self._moved(active[rid], status, t_start_ns if status is State.PREEMPTED else t_end_ns)
        for out in result.outputs:
            if out.finished and out.request_id in active:
                self._end(active[out.request_id], out, t_end_ns)

    def _prefilling(self, a, t_start_ns: int) -> None:
        s = self.spans.setdefault(a.request_id, _Spans())
        if s.prefill is None and s.decode is None:
            s.prefill = telemetry.tracer().start_span(
                "prefill",
                context=telemetry.context_from(a.traceparent),
                start_time=t_start_ns,
                attributes={
                    "conveyor.request_id": a.request_id,
                    "gen_ai.usage.input_tokens": a.prompt_len,
                    "conveyor.resumed_tokens": len(a.output_token_ids),
                },
            )
        span = s.prefill or s.decode
        telemetry.transition_event(a.request_id, State.PREFILLING, "", t_start_ns / 1e9, span=span)

    def _chunks(self, t_end_ns: int) -> None:
        for rid, s in self.spans.items():
            if s.prefill is not None and (computed := self.engine.computed_tokens(rid)) is not None:
                s.prefill.add_event("prefill_chunk", {"conveyor.computed_tokens": computed}, timestamp=t_end_ns)

    def _moved(self, a, status: State, t_ns: int) -> None:
        s = self.spans.setdefault(a.request_id, _Spans())
        if status is State.DECODING:
            if s.prefill is not None:
                self._close_prefill(a.request_id, s, t_ns)
            if s.decode is None:
                s.decode = telemetry.tracer().start_span(
                    "decode",
                    context=telemetry.context_from(a.traceparent),
                    start_time=t_ns,
                    attributes={"conveyor.request_id": a.request_id},
                )
                s.decode.add_event("first_token", timestamp=t_ns)
        elif status is State.PREEMPTED:
            s.preemptions += 1
        span = s.decode or s.prefill
        telemetry.transition_event(a.request_id, status, "", t_ns / 1e9, span=span)

    def _close_prefill(self, rid: str, s: _Spans, t_end_ns: int) -> None:
        info = self.engine.request_kv_info(rid)
        if info is not None:
            s.prefill.set_attribute("gen_ai.usage.cache_read.input_tokens", int(info[1]))
            s.prefill.set_attribute("conveyor.cached_tokens", int(info[1]))
            s.prefill.set_attribute("conveyor.kv_blocks", int(info[0]))
        s.prefill.end(end_time=t_end_ns)
        s.prefill = None

    def _end(self, a, out, t_end_ns: int) -> None:
        s = self.spans.pop(a.request_id, None)
        if s is None:
            return
        span = s.decode or s.prefill
        if span is not None:
            span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": len(a.output_token_ids),
                    "conveyor.preemptions": s.preemptions,
                    "gen_ai.response.finish_reasons": [out.finish_reason or out.error_reason or ""],
                }
            )
            to = State.FAILED if out.error_reason else State.FINISHED
            telemetry.transition_event(a.request_id, to, "", t_end_ns / 1e9, reason=out.error_reason or "", span=span)
            if out.error_reason:
                telemetry.set_error(span, out.error_reason, out.error or out.error_reason)
        self._finish(s, t_end_ns)

    def abort(self, request_id: str, reason: str, error: bool = True) -> None:
        """The request left the engine other than by finishing (cancelled, timed out, handed back)."""
        s = self.spans.pop(request_id, None)
        if s is None:
            return
        for span in (s.prefill, s.decode):
            if span is not None and error:
                telemetry.set_error(span, reason)
            if span is not None:
                span.add_event("aborted", {"conveyor.reason": reason})
        self._finish(s, time.time_ns())

    @staticmethod
    def _finish(s: _Spans, t_end_ns: int) -> None:
        for span in (s.prefill, s.decode):
            if span is not None:
                span.end(end_time=t_end_ns)
