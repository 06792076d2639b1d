"""One table decides a request's outcome (services/gateway/session/outcome.py): the HTTP status and error, a native
stream's finish_reason, the Prometheus counter and the span's status all come from the same row, so no two can
disagree about how a request ended."""

from __future__ import annotations

import pytest

from services.gateway.edge.errors import GatewayError
from services.gateway.session.metrics import GatewayMetrics
from services.gateway.session.outcome import FAILED_ROWS, OUTCOMES, ending, ending_from_context
from shared.state.context_store import Snapshot
from shared.wire.events import Cancelled, Failed, TimedOut
from shared.state.lifecycle import TERMINAL, State
from tests.support.factories import completed


def failed(reason: str, **kw) -> Failed:
    return Failed(request_id="r", reason=reason, message=f"it failed ({reason})", **kw)


ENDINGS = [  # (ending, state in Redis, HTTP status, native stream finish_reason, counter, label)
    (completed("r", "length", prompt_tokens=3, output_tokens=2), State.FINISHED, 200, "length", "success", "length"),
    (failed("invalid", param="max_tokens"), State.FAILED, 400, "error", "failure", "invalid"),
    (failed("too_long"), State.FAILED, 400, "error", "failure", "too_long"),
    (failed("worker_lost"), State.FAILED, 503, "error", "failure", "worker_lost"),
    (failed("state_lost"), State.FAILED, 503, "error", "failure", "state_lost"),
    (failed("overloaded", retry_after_s=3), State.FAILED, 429, "error", "failure", "overloaded"),
    (failed("oom"), State.FAILED, 500, "error", "failure", "oom"),
    (TimedOut(request_id="r", state=State.QUEUED), State.TIMED_OUT, 504, "timeout", "timeouts", None),
    (
        Cancelled(request_id="r", reason="client_cancel"),
        State.CANCELLED,
        499,
        "cancelled",
        "cancellations",
        "client_cancel",
    ),
]


@pytest.mark.parametrize("end,state,status,finish,counter,label", ENDINGS)
def test_every_party_reads_an_ending_from_one_row(end, state, status, finish, counter, label):
    how = ending(end)
    assert (how.outcome.state, how.outcome.status, how.finish_reason) == (state, status, finish)
    metrics = GatewayMetrics()
    metrics.observe_end(end, {}, [], 0)
    family = f"conveyor:{'request_' if counter in ('success', 'failure') else ''}{counter}"
    labels = {} if label is None else {"finished_reason" if counter == "success" else "reason": label}
    assert metrics.registry.get_sample_value(f"{family}_total", labels) == 1
    if how.outcome.ok:
        return
    err = how.error({"partial": {}}, {"X-Request-Id": "r"}, getattr(end, "retry_after_s", 0))
    assert isinstance(err, GatewayError) and err.status == status and err.code == how.reason
    assert ("partial" in err.body()["error"]) == how.outcome.partial
    assert (err.headers or {}).get("Retry-After") == ("3" if status == 429 else None)


def test_an_invalid_input_names_its_field_and_other_failures_do_not():
    assert ending(failed("invalid", param="max_tokens")).error().param == "max_tokens"
    assert ending(failed("oom", param="x")).error({}).param is None


def test_the_table_covers_every_terminal_state_and_only_those():
    assert {o.state for o in OUTCOMES.values()} == set(TERMINAL)
    assert set(FAILED_ROWS.values()) <= set(OUTCOMES)


def test_a_client_that_left_first_is_a_cancellation_and_counts_nowhere():
    how = ending(None)
    assert how.outcome.state == State.CANCELLED and how.reason == "client_disconnect"
    assert how.outcome.counter is None


@pytest.mark.parametrize("end", [e for e, *_ in ENDINGS])
def test_an_ending_built_from_the_context_lands_on_the_same_row(end):
    """The way back (a Redis Cluster's repair builds a lost ending from the state Redis holds)."""
    state = ending(end).outcome.state
    meta = {"reason": getattr(end, "reason", "") or getattr(end, "finish_reason", "")}
    snap = Snapshot("r", state, {"meta": meta}, [{"state": state.value, "from": "QUEUED", "t": 1.0}])
    assert ending(ending_from_context("r", snap)).outcome.state == state
