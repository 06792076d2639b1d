"""Tracing: one OpenTelemetry trace per request, across every service, carried inside the events.

- `setup(service, settings)` installs an SDK tracer provider exporting OTLP over HTTP/protobuf, only
  when an endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or `CONVEYOR_OTLP_ENDPOINT`). Otherwise the
  tracer stays the API's no-op one: spans are non-recording and nothing is built for them (every
  helper checks `is_recording()` before making attributes).
- The W3C `traceparent` of the producing span travels in every event's `traceparent` field: the
  producer injects (`traceparent_of`), the consumer extracts (`context_from`).
- Messaging spans follow OpenTelemetry's messaging conventions (`messaging.system` = redis).
- `shutdown()` flushes what is still buffered; every service calls it when it stops.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Iterator

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

logger = logging.getLogger(__name__)

_provider = None  # the SDK provider, when exporting
_tracer: trace.Tracer = trace.NoOpTracer()
_capture_content = False


def setup(service: str, settings) -> bool:
    """Export spans of this process as `service.name` = conveyor-<service>; False when tracing is off."""
    global _provider, _tracer, _capture_content
    endpoint = getattr(settings, "otlp_endpoint", "")
    if not settings.otel_enabled or not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if settings.otlp_protocol != "http/protobuf":
        logger.warning("OTLP protocol %s is not supported; exporting http/protobuf", settings.otlp_protocol)
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"conveyor-{service}", "service.namespace": settings.namespace})
    )
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=traces_url(endpoint)), schedule_delay_millis=settings.otel_schedule_delay_ms
        )
    )
    _provider, _tracer = provider, provider.get_tracer("conveyor")
    _capture_content = settings.otel_capture_content
    logger.info("tracing: exporting spans of %s to %s", service, traces_url(endpoint))
    return True


def traces_url(endpoint: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT is the base URL; traces go to <base>/v1/traces."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def shutdown() -> None:
    """Flush buffered spans and stop exporting (on service stop)."""
    global _provider, _tracer
    if _provider is None:
        return
    _provider.force_flush(5000)
    _provider.shutdown()
    _provider, _tracer = None, trace.NoOpTracer()


def enabled() -> bool:
    return _provider is not None


def capture_content() -> bool:
    """Prompt and output text go into spans only when CONVEYOR_OTEL_CAPTURE_CONTENT is on."""
    return _capture_content


def tracer() -> trace.Tracer:
    return _tracer


# --- W3C trace context -------------------------------------------------------------------------


def traceparent_of(span: Span | None, fallback: str = "") -> str:
    """The W3C traceparent of `span`; `fallback` when it has no valid context (tracing off)."""
    ctx = span.get_span_context() if span is not None else None
    if ctx is None or not ctx.is_valid:
        return fallback
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def current_traceparent(fallback: str = "") -> str:
    return traceparent_of(trace.get_current_span(), fallback)


def parse(traceparent: str) -> SpanContext | None:
    """A remote SpanContext from a W3C traceparent; None when absent or malformed."""
    parts = traceparent.strip().split("-") if traceparent else []
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or parts[0] == "ff":
        return None
    try:
        tid, sid, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if tid == 0 or sid == 0:
        return None
    return SpanContext(tid, sid, is_remote=True, trace_flags=TraceFlags(flags & 0xFF))


def context_from(traceparent: str) -> Context | None:
    """The context to start a child span in (extraction); None (a new root) when there is none."""
    if _provider is None:
        return None
    sc = parse(traceparent)
    return trace.set_span_in_context(NonRecordingSpan(sc)) if sc is not None else None


def new_traceparent() -> str:
    """A fresh, unsampled trace context: with tracing off a request still gets a trace id to show."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-00"


def trace_id(traceparent: str) -> str:
    parts = traceparent.split("-")
    return parts[1] if len(parts) >= 4 else ""


# --- spans ----------------------------------------------------------------------------------------


def set_error(span: Span, reason: str, message: str = "") -> None:
    if span.is_recording():
        reason = str(reason)  # a plain str for the exporters, from a Reason too
        span.set_status(Status(StatusCode.ERROR, message or reason))
        span.set_attribute("error.type", reason)


def transition_event(
    request_id: str, to: str, previous: str, at: float, reason: str = "", span: Span | None = None
) -> None:
    """A span event for one lifecycle transition (on `span`, else the current span), at Redis's time."""
    span = span if span is not None else trace.get_current_span()
    if not span.is_recording():
        return
    to = str(to)  # plain strs for the exporters, from a State or a Reason too
    attrs = {"conveyor.request_id": request_id, "conveyor.state": to, "conveyor.state.from": str(previous)}
    if reason:
        attrs["conveyor.reason"] = str(reason)
    span.add_event(to, attrs, timestamp=int(at * 1e9) if at else None)


def messaging_attrs(operation: str, stream: str, group: str = "", message_id: str = "", client_id: str = "") -> dict:
    attrs = {
        "messaging.system": "redis",
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": stream,
    }
    if group:
        attrs["messaging.consumer.group.name"] = group
    if message_id:
        attrs["messaging.message.id"] = message_id
    if client_id:
        attrs["messaging.client.id"] = client_id
    return attrs


@contextmanager
def publish_span(stream: str, request_id: str = "", context: Context | None = None) -> Iterator[Span]:
    """A PRODUCER span around one publish; inject its traceparent into the event it publishes."""
    with trace.use_span(
        start_publish_span(stream, request_id, context), end_on_exit=True, record_exception=False
    ) as span:
        yield span


def start_publish_span(stream: str, request_id: str = "", context: Context | None = None) -> Span:
    """publish_span's span started, not made current: a batch opens one per request and ends it once the
    request's events are out (end_all)."""
    span = _tracer.start_span(
        f"publish {short(stream)}", context=context, kind=SpanKind.PRODUCER, record_exception=False
    )
    if span.is_recording():
        span.set_attributes(messaging_attrs("publish", stream))
        if request_id:
            span.set_attribute("conveyor.request_id", request_id)
    return span


@contextmanager
def current(span: Span | None) -> Iterator[None]:
    """Make a span started earlier (start_*_span) the current one for a while, without ending it: what is
    recorded meanwhile (a transition's event, a child span) goes on it. Nothing with tracing off."""
    if span is None or _provider is None:
        yield
        return
    with trace.use_span(span, end_on_exit=False, record_exception=False):
        yield


def end_all(*spans: Span | None) -> None:
    for span in spans:
        if span is not None:
            span.end()


def published(span: Span, entry_ids) -> None:
    """Record the stream entry id a publish got."""
    if span.is_recording() and entry_ids:
        span.set_attribute("messaging.message.id", str(entry_ids[0]))


@contextmanager
def process_span(delivery, consumer: str) -> Iterator[Span]:
    """A CONSUMER span around the handling of one delivery, child of the event's producer span."""
    if _provider is None:
        yield trace.INVALID_SPAN
        return
    with trace.use_span(start_process_span(delivery, consumer), end_on_exit=True, record_exception=False) as span:
        yield span


def start_process_span(delivery, consumer: str) -> Span | None:
    """process_span's span started, not made current (None with tracing off): a batch opens one per delivery
    it handles together with others, makes it current() for that delivery's work, and ends it (end_all)."""
    if _provider is None:
        return None
    ev = delivery.event
    span = _tracer.start_span(
        f"process {short(delivery.stream)}",
        context=context_from(ev.traceparent),
        kind=SpanKind.CONSUMER,
        record_exception=False,
    )
    span.set_attributes(messaging_attrs("process", delivery.stream, delivery.group, delivery.entry_id, consumer))
    rid = getattr(ev, "request_id", "")
    if rid:
        span.set_attribute("conveyor.request_id", rid)
    span.set_attribute("conveyor.event", type(ev).__struct_config__.tag)
    return span


def short(stream: str) -> str:
    """A stream's name without the namespace, partition or hash tag, for span names (`{ns}:stream:worker:{w1}` ->
    `worker:w1`, `{ns}:{0.3}:stream:received` -> `received`)."""
    return stream.split(":stream:", 1)[-1].replace("{", "").replace("}", "")


def genai_request_attrs(operation: str, model: str, sampling) -> dict:
    return {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
    }
