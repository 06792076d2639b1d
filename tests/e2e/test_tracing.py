"""Tracing end to end: a whole local cluster exports OTLP/HTTP to a real receiver in the test.

One request is one trace through gateway, tokenizer, scheduler and worker; parents follow the events on
the bus; the queue span is queue_wait and the first-token event is ttft; cancelled and timed-out requests
end in ERROR with their reason; a client's traceparent is continued.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from shared.process import telemetry
from tests.support.cluster import Cluster, running
from tests.support.cache import CACHE_DIR
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.openai_fixtures import worker_idle
from tests.support.waiting import wait_for

STAGES = ("tokenize", "queue", "schedule", "prefill", "decode", "stream")
ERROR = 2


@pytest.fixture(scope="module")
def traced(tmp_path_factory, model_dir):
    receiver = OtlpReceiver().start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "CONVEYOR_OTEL_SCHEDULE_DELAY_MS": "100"}
    try:
        with running(Cluster(tmp_path_factory.mktemp("traced"), CACHE_DIR, env=env)) as cluster:
            yield cluster, receiver
    finally:
        receiver.stop()


def _trace_id(response: httpx.Response) -> str:
    tp = response.headers["traceparent"]
    assert telemetry.parse(tp) is not None, tp
    return telemetry.trace_id(tp)


def _wait_spans(receiver: OtlpReceiver, trace_id: str, names, what: str):
    def check():
        spans = receiver.trace(trace_id)
        have = {s.name for s in spans}
        return spans if all(n in have for n in names) else None

    return wait_for(check, 30, 0.1, what)


def _root(spans):
    return next(s for s in spans if s.service == "conveyor-gateway" and s.name.startswith("POST "))


def test_one_request_is_one_trace_across_the_four_services(traced):
    cluster, receiver = traced
    r = httpx.post(
        f"{cluster.url}/generate",
        timeout=120,
        json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body, tid = r.json(), _trace_id(r)
    meta = httpx.get(f"{cluster.url}/v1/requests/{body['request_id']}", timeout=10).json()["meta"]
    assert telemetry.trace_id(meta["traceparent"]) == tid

    spans = _wait_spans(receiver, tid, ("POST /generate", *STAGES), "every stage's span exported")
    assert {s.service for s in spans} == {
        "conveyor-gateway",
        "conveyor-tokenizer",
        "conveyor-scheduler",
        "conveyor-worker",
    }
    names = [s.name for s in spans]
    for stage in STAGES:
        assert names.count(stage) == 1, (stage, names)
    by_name = {s.name: s for s in spans}
    root = _root(spans)
    _assert_parents(spans, by_name, root)
    for s in spans:
        assert s.attributes.get("conveyor.request_id") == body["request_id"], s.name

    metrics = body["metrics"]
    assert abs(by_name["queue"].duration_s - metrics["queue_wait"]) < 0.005
    first = by_name["stream"].event("first_token")
    assert first is not None and abs((first[1] - root.start_ns) / 1e9 - metrics["ttft"]) < 0.005

    events = {e[0] for s in spans for e in s.events}
    assert {"RECEIVED", "PREPROCESSED", "QUEUED", "SCHEDULED", "PREFILLING", "DECODING", "FINISHED"} <= events
    assert by_name["prefill"].event("prefill_chunk") is not None
    assert by_name["prefill"].attributes["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert "conveyor.cached_tokens" in by_name["prefill"].attributes

    _assert_genai(root.attributes, body)
    assert not any("France" in str(v) for s in spans for v in s.attributes.values())  # no prompt text

    consumed = by_name["process preprocessed"].attributes
    assert consumed["messaging.system"] == "redis" and consumed["messaging.consumer.group.name"] == "scheduler"
    assert consumed["messaging.destination.name"].endswith(":stream:preprocessed")
    assert consumed["messaging.message.id"] == by_name["publish preprocessed"].attributes["messaging.message.id"]
    assert "conveyor.schedule.scores" in by_name["schedule"].attributes
    reply = [s for s in spans if s.name.startswith("process reply:") and s.service == "conveyor-gateway"]
    assert len(reply) == 1 and reply[0].attributes["conveyor.event"] == "completed"
    assert reply[0].attributes["messaging.consumer.group.name"] == "gateway"


def _assert_parents(spans, by_name, root) -> None:
    """The span tree follows the events on the bus (producer -> consumer), rooted at the HTTP span."""
    assert root.parent_id == "" and root.kind == 2  # SERVER

    def parent(name):
        return next(s for s in spans if s.span_id == by_name[name].parent_id).name

    assert parent("publish received") == root.name and parent("stream") == root.name
    assert parent("process received") == "publish received"
    assert parent("tokenize") == parent("publish preprocessed") == "process received"
    assert parent("process preprocessed") == parent("queue") == parent("schedule") == "publish preprocessed"
    worker_stream = next(s.name for s in spans if s.name.startswith("publish worker:"))
    assert parent(worker_stream) == "schedule" and by_name[worker_stream].kind == 4  # PRODUCER
    assert parent("process " + worker_stream[len("publish ") :]) == worker_stream
    assert parent("prefill") == parent("decode") == "process " + worker_stream[len("publish ") :]


def _assert_genai(a: dict, body: dict) -> None:
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0
    assert a["gen_ai.request.top_p"] == 1.0 and a["gen_ai.response.id"] == body["request_id"]
    assert a["gen_ai.response.finish_reasons"] == [body["finish_reason"]]
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]


def test_cancelled_request_trace_ends_in_error(traced):
    cluster, receiver = traced
    seen: list[dict] = []
    started, headers = threading.Event(), {}

    def consume():
        with httpx.stream(
            "POST",
            f"{cluster.url}/generate",
            timeout=120,
            json={
                "prompt": "Count to a thousand:",
                "max_tokens": 2000,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            },
        ) as r:
            headers.update(r.headers)
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen.append(json.loads(line[6:]))
                    started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(60)
    assert httpx.delete(f"{cluster.url}/v1/requests/{seen[0]['request_id']}", timeout=10).json()["cancelled"]
    t.join(60)
    tid = telemetry.trace_id(headers["traceparent"])
    spans = _wait_spans(receiver, tid, ("POST /generate", "decode", "stream"), "cancelled request's spans")
    root = _root(spans)
    assert root.status_code == ERROR and "client_cancel" in root.status_message
    assert root.attributes["error.type"] == "client_cancel"
    assert any(e[0] == "CANCELLED" for e in root.events)
    decode = next(s for s in spans if s.name == "decode")
    assert decode.status_code == ERROR and decode.attributes["error.type"] == "client_cancel"


def test_timed_out_request_trace_ends_in_error(traced):
    cluster, receiver = traced
    # Nothing ahead of it: a request the queued work would keep from starting in time is refused at once (429), and
    # this one must time out while it runs (the cancel test before it may still hold the worker for a moment).
    wait_for(lambda: worker_idle(cluster), 60, 0.1, "the worker idle")
    r = httpx.post(
        f"{cluster.url}/generate",
        timeout=120,
        json={
            "prompt": "Count to a thousand:",
            "max_tokens": 2000,
            "ignore_eos": True,
            "temperature": 0,
            "timeout": 1.5,
        },
    )
    assert r.status_code == 504, r.text
    tid = _trace_id(r)
    _wait_spans(receiver, tid, ("POST /generate", "stream"), "timed-out request's spans")

    def marked_timed_out():
        # each service exports on its own schedule: the mark may arrive after the gateway's spans
        spans = receiver.trace(tid)
        marked = any(e[0] == "TIMED_OUT" for s in spans for e in s.events) or any(
            s.status_code == ERROR and s.service == "conveyor-worker" for s in spans
        )
        return spans if marked else None

    spans = wait_for(marked_timed_out, 30, 0.1, "a TIMED_OUT event or a worker span in error")
    root = _root(spans)
    assert root.status_code == ERROR and root.attributes["error.type"] == "timeout"
    assert "timed out" in root.status_message


def test_client_traceparent_is_continued(traced):
    cluster, receiver = traced
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        timeout=120,
        headers={"traceparent": f"00-{tid}-{sid}-01"},
        json={
            "model": httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]["id"],
            "prompt": "Hello",
            "max_tokens": 3,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    assert _trace_id(r) == tid
    spans = _wait_spans(receiver, tid, ("POST /v1/completions", "decode"), "continued trace")
    root = _root(spans)
    assert root.parent_id == sid
    assert {s.service for s in spans} >= {"conveyor-gateway", "conveyor-worker"}


def test_no_endpoint_means_no_op_tracing():
    from shared.settings import WorkerSettings

    assert telemetry.setup("worker", WorkerSettings(CONVEYOR_OTLP_ENDPOINT="")) is False
    assert not telemetry.enabled() and telemetry.context_from("00-" + "1" * 32 + "-" + "2" * 16 + "-01") is None
    assert telemetry.traces_url("http://h:4318/") == "http://h:4318/v1/traces"
    assert telemetry.parse("garbage") is None


def test_the_choices_of_one_request_are_one_trace_their_roots_under_the_first(traced):
    cluster, receiver = traced
    r = httpx.post(
        f"{cluster.url}/generate",
        timeout=120,
        json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "n": 3},
    )
    assert r.status_code == 200, r.text
    ids, tid = [c["request_id"] for c in r.json()["choices"]], _trace_id(r)

    def three_whole_requests():
        spans = receiver.trace(tid)
        return (
            spans
            if sum(s.name == "stream" for s in spans) == 3 and sum(s.name == "decode" for s in spans) == 3
            else None
        )

    spans = wait_for(three_whole_requests, 30, 0.1, "every choice's spans exported")
    roots = {s.attributes["conveyor.request_id"]: s for s in spans if s.name == "POST /generate"}
    assert set(roots) == set(ids)
    first = roots[ids[0]]
    assert first.parent_id == "" and all(roots[rid].parent_id == first.span_id for rid in ids[1:])
