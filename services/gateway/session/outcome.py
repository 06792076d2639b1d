"""A request's terminal outcome: one table from how it ended to everything derived from that.

How a request ended (its terminal event, or none when its client left first) decides the state Redis holds, the
HTTP status and error the client gets, the finish_reason of a native stream's last event, the Prometheus counter
and its label, and the span's status. Each of those is read from OUTCOMES, through `ending` (after vLLM v1's
_FINISHED_REASON_MAP: one frozen mapping, everything else derived), so no two of them can disagree; the way back,
from a state Redis holds to the event it calls for (a Redis Cluster's repair, services.gateway.session.reconcile), is
`ending_from_context` below the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from services.gateway.edge.errors import (
    GatewayError,
    InvalidRequest,
    Overloaded,
    RequestCancelled,
    RequestFailed,
    RequestTimedOut,
    Unavailable,
)
from shared.state.context_store import Snapshot
from shared.wire.events import AnyEvent, Cancelled, Completed, Failed, TimedOut
from shared.state.lifecycle import State


# Why the gateway cancels a request it holds: its client left, or a sibling choice ended the request first.
CLIENT_GONE, SIBLING_FAILED = "client_disconnect", "choice_failed"


@dataclass(frozen=True)
class Outcome:
    """One row: what one way of ending means for each party."""

    state: State  # the terminal state Redis holds
    error: type[GatewayError] | None  # what the client gets instead of the success body (None: the body)
    stream_finish: str | None  # finish_reason of a native stream's last event (None: the completion's own)
    counter: str | None  # GatewayMetrics' counter (None: not counted, the client left before any ending)
    labelled: bool = True  # the counter has a label: the ending's reason
    partial: bool = True  # the error carries the output so far (a refusal before any work has none)
    retry_after: bool = False  # the error tells when to try again (Retry-After)

    @property
    def status(self) -> int:
        return 200 if self.error is None else self.error.status

    @property
    def ok(self) -> bool:
        return self.error is None


OUTCOMES: Mapping[str, Outcome] = MappingProxyType(
    {
        "completed": Outcome(State.FINISHED, None, None, "success"),
        "invalid": Outcome(State.FAILED, InvalidRequest, "error", "failure", partial=False),
        "unavailable": Outcome(State.FAILED, Unavailable, "error", "failure"),
        "overloaded": Outcome(State.FAILED, Overloaded, "error", "failure", partial=False, retry_after=True),
        "failed": Outcome(State.FAILED, RequestFailed, "error", "failure"),
        "timed_out": Outcome(State.TIMED_OUT, RequestTimedOut, "timeout", "timeouts", labelled=False),
        "cancelled": Outcome(State.CANCELLED, RequestCancelled, "cancelled", "cancellations"),
        # No ending reached the handle: the client left first (its handler cancels the request as it goes).
        "client_gone": Outcome(State.CANCELLED, RequestCancelled, "cancelled", None),
    }
)
# A failure's row by its reason (shared.wire.events.Failed.reason); any other reason is "failed", a 500.
FAILED_ROWS: Mapping[str, str] = MappingProxyType(
    {
        "invalid": "invalid",
        "too_long": "invalid",  # the input was refused: nothing ran
        "worker_lost": "unavailable",
        "state_lost": "unavailable",  # the cluster lost it: send it again
        "overloaded": "overloaded",  # refused by the scheduler before it could start
    }
)


@dataclass(frozen=True)
class Ending:
    """An ending read through the table: its row and the words for it."""

    outcome: Outcome
    reason: str  # a completion's finish_reason; else the error code, the counter's label and the span's error type
    message: str  # the client's error message ("" for a completion)
    span_message: str  # the span's status description
    param: str | None = None  # the error's param

    @property
    def finish_reason(self) -> str:
        """What a native stream's last event says: the completion's finish_reason, or the kind of error."""
        return self.outcome.stream_finish or self.reason

    def error(self, extra: dict | None = None, headers: dict | None = None, retry_after_s: int = 0) -> GatewayError:
        """The client's error (raise it); extra: the output so far, kept when the row carries it."""
        assert self.outcome.error is not None, "a completion is no error"
        if self.outcome.retry_after:
            headers = {**(headers or {}), "Retry-After": str(retry_after_s)}
        return self.outcome.error(
            self.message, self.param, self.reason, extra=extra if self.outcome.partial else None, headers=headers
        )


def ending(end: AnyEvent | None) -> Ending:
    """The row and words of an ending (None: the client left before any)."""
    if isinstance(end, Completed):
        return Ending(OUTCOMES["completed"], end.finish_reason, "", "")
    if isinstance(end, Failed):
        row = OUTCOMES[FAILED_ROWS.get(end.reason, "failed")]
        param = (end.param or None) if row.error is InvalidRequest else None  # a refused input names its field
        return Ending(row, end.reason, end.message, end.message, param)
    if isinstance(end, TimedOut):
        where = end.state or end.service or "unknown"  # the state it timed out in, else who timed it out
        return Ending(
            OUTCOMES["timed_out"],
            "timeout",
            f"the request did not finish within its timeout (it was {where})",
            f"timed out while {where}",
            "timeout",
        )
    if isinstance(end, Cancelled):
        return Ending(
            OUTCOMES["cancelled"], end.reason, f"the request was cancelled ({end.reason})", f"cancelled ({end.reason})"
        )
    if end is None:
        return Ending(OUTCOMES["client_gone"], CLIENT_GONE, "the client went away", "the client went away")
    name = type(end).__name__  # a defect: no other event ends a request
    return Ending(OUTCOMES["failed"], "internal", f"unexpected end event {name}", name)


def ending_from_context(rid: str, snap: Snapshot | None) -> AnyEvent | None:
    """The terminal event a request's context calls for (None: it holds no state). Its state picks the row."""
    if snap is None or snap.state is None:
        return None
    meta, out = snap.layers.get("meta", {}), snap.layers.get("output", {})
    reason = str(meta.get("reason") or "")
    if snap.state == OUTCOMES["completed"].state:
        kv, inp, ex = snap.layers.get("kv", {}), snap.layers.get("input", {}), snap.layers.get("exec", {})
        return Completed(
            request_id=rid,
            worker_id=str(ex.get("worker_id") or ""),
            finish_reason=str(out.get("finish_reason") or reason or "stop"),
            prompt_tokens=int(inp.get("prompt_tokens") or 0),
            output_tokens=int(out.get("output_tokens") or 0),
            cached_tokens=int(kv.get("cached_tokens") or 0),
            num_preemptions=int(out.get("num_preemptions") or 0),
        )
    if snap.state == OUTCOMES["failed"].state:
        return Failed(
            request_id=rid,
            reason=reason or "internal",
            service="gateway",
            message=str(meta.get("message") or f"the request failed ({reason or 'internal'})"),
        )
    if snap.state == OUTCOMES["cancelled"].state:
        return Cancelled(request_id=rid, reason=reason or "client_cancel", service="gateway")
    history = snap.history
    where = history[-1].get("from", "") if history else ""
    return TimedOut(request_id=rid, state=State(where) if where else None, service="gateway")
