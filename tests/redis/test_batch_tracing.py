"""One path, traced or not: a tick's requests taken in and placed together still get one set of spans each, with
the parents and the event traceparents the end-to-end tracing test (test_tracing.py) follows."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler import batch
from shared.process import telemetry
from shared.wire.bus import Delivery
from tests.support.scheduling import heartbeat, preprocessed_request, scheduled_on, scheduler


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_provider", provider)
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def test_requests_taken_in_and_placed_together_get_their_own_spans(redis_server, redis_client, names, spans):
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat())
    evs = [preprocessed_request(redis_server, names) for _ in range(2)]
    stream = names.preprocessed_stream(0)
    batch.intake(s, [Delivery(stream, "scheduler", f"0-{i + 1}", ev) for i, ev in enumerate(evs)])
    s.place()

    done = spans.get_finished_spans()
    rids = {ev.request_id for ev in evs}

    def of(name):
        return {sp.attributes["conveyor.request_id"]: sp for sp in done if sp.name == name}

    processed, schedules = of("process preprocessed"), of("schedule")
    publishes = of("publish worker:w1")
    assert set(processed) == set(schedules) == set(publishes) == rids
    for rid in rids:
        assert [e.name for e in processed[rid].events] == ["QUEUED"]
        assert publishes[rid].parent.span_id == schedules[rid].context.span_id
        assert [e.name for e in publishes[rid].events] == ["SCHEDULED"]
        assert publishes[rid].attributes["messaging.message.id"]
    sent = {ev.request_id: ev for ev in scheduled_on(redis_client, names)}
    for rid in rids:  # each scheduled event carries its own publish span's context
        assert telemetry.parse(sent[rid].traceparent).span_id == publishes[rid].context.span_id
    assert {sp.attributes["conveyor.request_id"] for sp in done if sp.name == "queue"} == rids


def test_without_tracing_the_same_path_places_them_and_opens_no_span(redis_server, redis_client, names):
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat())
    evs = [preprocessed_request(redis_server, names) for _ in range(2)]
    batch.intake(s, [Delivery(names.preprocessed_stream(0), "scheduler", f"0-{i + 1}", ev) for i, ev in enumerate(evs)])
    s.place()
    sent = scheduled_on(redis_client, names)
    assert {ev.request_id for ev in sent} == {ev.request_id for ev in evs}
    assert [ev.traceparent for ev in sent] == ["", ""]  # nothing of a span: the events' own (none here)
