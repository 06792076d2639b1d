"""Refusing at once what cannot start in time: a request the work queued ahead of it keeps from starting before its
deadline gets a 429 with Retry-After (Failed "overloaded"), not a 504 after waiting its whole timeout. Judged on
arrival and again each second with the latest costs (issue 24, item 11)."""

from __future__ import annotations

import logging
import math
import time

from services.scheduler.deadlines import Costs, Work
from shared.wire.events import Failed, Reason
from shared.state.lifecycle import Publish, State

logger = logging.getLogger(__name__)


def refuse_if_too_late(
    s, item, costs: Costs | None = None, ahead: Work | None = None, requests_ahead: int | None = None
) -> bool:
    """A request the work queued ahead of it keeps from even starting before its deadline is refused now (429
    with Retry-After at the gateway), not held for its whole timeout only to time out: the adaptive deadline's
    work model prices that wait. Without measured costs (no heartbeat yet) nothing is refused."""
    costs = costs or Costs.of([w.hb for w in s._live_views()])
    if costs is None:
        return False
    if ahead is None:
        ahead, requests_ahead = s.queue.work_ahead_of(item), s.queue.count_ahead_of(item)
    wait = costs.wait_to_start(ahead, requests_ahead)
    left = item.event.deadline - time.time()
    if wait <= left:
        return False
    s.queue.remove(item.request_id)
    ev = item.event
    answer = Failed(
        request_id=ev.request_id,
        reason=Reason.OVERLOADED,
        service="scheduler",
        retry_after_s=max(1, math.ceil(wait - left)),
        traceparent=ev.traceparent,
        message=f"the server is overloaded: the work queued ahead of this request needs about "
        f"{wait:.0f} s, longer than its {max(0.0, left):.0f} s left; retry later",
    )
    s._try(ev.request_id, State.FAILED, Reason.OVERLOADED, [Publish(ev.reply_to, answer)], only_from=(State.QUEUED,))
    logger.info("refused %s: %.0f s of work ahead, %.0f s left", ev.request_id, wait, left)
    return True


def refuse_those_too_late(s) -> None:
    """Judge every queued request again with the latest costs (once a second): steps that got slower since it
    arrived (a busier machine) can mean it will no longer start in time, and it is refused then rather than
    held until its timeout. One pass in queue order."""
    costs = Costs.of([w.hb for w in s._live_views()])
    if costs is None or not len(s.queue):
        return
    refused, prefill, decode, kept = [], 0, 0, 0
    for q in s.queue.in_order():
        if refuse_if_too_late(s, q, costs, Work(prefill, decode), kept):
            refused.append(q.request_id)  # no longer ahead of those behind it
            continue
        own = q.work()
        prefill, decode, kept = prefill + own.prefill_tokens, decode + own.decode_tokens, kept + 1
    s.records.drop(refused)
