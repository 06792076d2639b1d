"""The gateway's spans: the HTTP span (the root of a request's trace, or a child of the client's
`traceparent`), the publish of request_received, and `stream` (the gateway relaying output to the
client, with a `first_token` event at the very instant ttft measures).

Client-side times are perf_counter readings mapped onto the wall clock from the receipt, so span times
and the request's metrics (ttft, e2e) agree exactly. With tracing off the request still gets a
traceparent (the client's trace id, else a fresh one) to show in its response and meta layer.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from services.gateway.session.outcome import ending
from shared.process import telemetry


@dataclass
class RequestTrace:
    root: Span  # the HTTP span
    traceparent: str  # of the root: in the response header and the meta layer
    publish: Span  # the PRODUCER span of request_received
    publish_tp: str  # carried by request_received
    t0_ns: int  # wall clock at receipt
    t0_perf: float  # perf_counter at receipt (the handle's t0)
    sent_ns: int = 0  # wall clock once request_received was published


def start_trace(rid: str, req, sampling, model: str, route: str, client_tp: str, t0_perf: float) -> RequestTrace:
    t0_ns = time.time_ns()
    if not telemetry.enabled():
        sc = telemetry.parse(client_tp)
        tp = (
            f"00-{sc.trace_id:032x}-{os.urandom(8).hex()}-{int(sc.trace_flags):02x}"
            if sc is not None
            else telemetry.new_traceparent()
        )
        return RequestTrace(INVALID_SPAN, tp, INVALID_SPAN, tp, t0_ns, t0_perf)
    attrs = telemetry.genai_request_attrs("chat" if req.messages else "text_completion", model, sampling)
    attrs.update(
        {
            "conveyor.request_id": rid,
            "gen_ai.response.id": rid,
            "http.request.method": "POST",
            "http.route": route,
            "url.path": route,
            "conveyor.priority": req.priority,
            "conveyor.stream": bool(req.stream),
        }
    )
    if telemetry.capture_content():
        attrs["gen_ai.prompt"] = (
            req.prompt
            if req.prompt is not None
            else "\n".join(f"{m.role}: {m.content}" for m in req.messages or []) or str(req.prompt_token_ids)
        )
    root = telemetry.tracer().start_span(
        f"POST {route}",
        context=telemetry.context_from(client_tp),
        kind=SpanKind.SERVER,
        start_time=t0_ns,
        attributes=attrs,
    )
    pub = telemetry.tracer().start_span(
        "publish received", context=trace.set_span_in_context(root), kind=SpanKind.PRODUCER
    )
    return RequestTrace(root, telemetry.traceparent_of(root), pub, telemetry.traceparent_of(pub), t0_ns, t0_perf)


def untraced(traceparent: str, t0_perf: float) -> RequestTrace:
    """The trace of a request another gateway created (a taken-over background response): its traceparent only,
    no span of this gateway's."""
    tp = traceparent or telemetry.new_traceparent()
    return RequestTrace(INVALID_SPAN, tp, INVALID_SPAN, tp, time.time_ns(), t0_perf)


def published(rt: RequestTrace, request_id: str, stream: str) -> None:
    """request_received is on the bus (and the request RECEIVED)."""
    rt.sent_ns = time.time_ns()
    if rt.root.is_recording():
        rt.publish.set_attributes(telemetry.messaging_attrs("publish", stream))
        rt.publish.set_attribute("conveyor.request_id", request_id)
        rt.publish.end(end_time=rt.sent_ns)
        telemetry.transition_event(request_id, "RECEIVED", "", rt.sent_ns / 1e9, span=rt.root)


def refused(rt: RequestTrace, error: BaseException) -> None:
    """The request was never created (overloaded, not ready, Redis away)."""
    if rt.root.is_recording():
        reason = getattr(error, "code", None) or type(error).__name__
        for span in (rt.publish, rt.root):
            telemetry.set_error(span, str(reason), str(error))
            span.end()


def reply_processed(handle, ev, stream: str, group: str, consumer: str, entry_id) -> None:
    """A CONSUMER span for a reply (completed, failed, cancelled, timed_out) taken off this gateway's stream."""
    rt = getattr(handle, "trace", None)
    if rt is None or not rt.root.is_recording():
        return
    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    attrs = telemetry.messaging_attrs("process", stream, group, eid, consumer)
    attrs.update({"conveyor.request_id": handle.request_id, "conveyor.event": type(ev).__struct_config__.tag})
    ctx = telemetry.context_from(ev.traceparent) or trace.set_span_in_context(rt.root)
    telemetry.tracer().start_span(
        f"process {telemetry.short(stream)}", context=ctx, kind=SpanKind.CONSUMER, attributes=attrs
    ).end()


def active(handle):
    """Make the request's HTTP span current (so its gateway-side transitions become its events)."""
    rt = getattr(handle, "trace", None)
    if rt is None or not rt.root.is_recording():
        return contextlib.nullcontext()
    return trace.use_span(rt.root, end_on_exit=False)


def _wall(rt: RequestTrace, perf: float) -> int:
    return rt.t0_ns + int((perf - rt.t0_perf) * 1e9)


def finish_trace(handle) -> None:
    """The client has its answer (or left): the stream span, the outcome on the root, and its end."""
    rt = getattr(handle, "trace", None)
    if rt is None or not rt.root.is_recording():
        return
    end_ns = _wall(rt, handle.ended_at if handle.ended_at is not None else time.perf_counter())
    stream = telemetry.tracer().start_span(
        "stream",
        context=trace.set_span_in_context(rt.root),
        start_time=rt.sent_ns or rt.t0_ns,
        attributes={
            "conveyor.request_id": handle.request_id,
            "gen_ai.usage.output_tokens": len(handle.token_ids),
            "conveyor.deliveries": len(handle.token_times),
        },
    )
    if handle.first_token_at is not None:
        stream.add_event("first_token", timestamp=_wall(rt, handle.first_token_at))
    _outcome(rt.root, stream, handle)
    stream.end(end_time=end_ns)
    rt.root.end(end_time=max(end_ns, time.time_ns()))


def _outcome(root: Span, stream: Span, handle) -> None:
    end = handle.ended
    root.set_attribute("gen_ai.usage.output_tokens", len(handle.token_ids))
    for k, v in (handle.metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            root.set_attribute(f"conveyor.metrics.{k}", v)
    how = ending(end)
    if how.outcome.ok:
        root.set_attributes(
            {
                "gen_ai.response.finish_reasons": [how.reason],
                "gen_ai.usage.input_tokens": end.prompt_tokens,
                "conveyor.cached_tokens": end.cached_tokens,
                "http.response.status_code": how.outcome.status,
            }
        )
        if telemetry.capture_content():
            root.set_attribute("gen_ai.completion", handle.full_text)
        return
    root.set_attribute("gen_ai.response.finish_reasons", [how.reason])
    for span in (stream, root):
        telemetry.set_error(span, how.reason, how.span_message)
