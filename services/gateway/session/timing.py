"""A request's own metrics (GET /v1/requests/{id}'s output layer, a response's "metrics"), once it ended.

Every interval is a difference of two timestamps of ONE clock: lifecycle intervals use the
history (Redis's clock, stamped by the transition script); client-facing intervals (ttft, itl,
tpot, e2e) use the gateway's monotonic clock from receipt. docs/metrics.md defines each one.
"""

from __future__ import annotations

import logging
import statistics

import redis

from shared.state.lifecycle import TERMINAL, State, parse_history

logger = logging.getLogger(__name__)


def lifecycle_intervals(history: list[dict]) -> dict:
    """Intervals from the transition history (Redis's clock)."""
    first: dict[str, float] = {}
    queue_wait, since = 0.0, None
    for h in history:
        first.setdefault(h["state"], h["t"])
        if h["state"] == State.QUEUED.value:
            since = h["t"]
        elif since is not None and h["from"] == State.QUEUED.value:
            queue_wait, since = queue_wait + (h["t"] - since), None
    end = history[-1]["t"] if history and State(history[-1]["state"]) in TERMINAL else None
    sched, prefill, token = (first.get(s.value) for s in (State.SCHEDULED, State.PREFILLING, State.DECODING))
    return {
        "queue_wait": queue_wait,
        "engine_ttft": token - sched if token and sched else None,
        "prefill_time": token - prefill if token and prefill else None,
        "decode_time": end - token if end and token else None,
    }


def client_intervals(t0: float, token_times: list[float], n_tokens: int, ended_at: float) -> dict:
    """Intervals on the gateway's clock: t0 is receipt; token_times are when each delta reached the client."""
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    first = token_times[0] if token_times else None
    return {
        "ttft": first - t0 if first is not None else None,
        "tpot": (token_times[-1] - first) / (n_tokens - 1) if first is not None and n_tokens > 1 else 0.0,
        "itl_p50": statistics.median(gaps) if gaps else 0.0,
        "itl_max": max(gaps) if gaps else 0.0,
        "e2e": ended_at - t0,
    }


QUEUE_TIME_HEADER = "x-queue-time"  # seconds the request waited in QUEUED (vLLM's header)


async def queue_wait(core, request_id: str) -> float | None:
    """The request's time in QUEUED so far, from its history (None if that cannot be read): what a stream's start
    reports, once its first output came (the wait is over by then)."""
    try:
        history = parse_history(await core.r.lrange(core.names.history(request_id), 0, -1))
    except redis.RedisError as e:
        logger.warning("request %s: no history for its queue wait (%r)", request_id, e)
        return None
    return lifecycle_intervals(history)["queue_wait"] if history else None


def queue_time_headers(seconds: float | None) -> dict:
    return {} if seconds is None else {QUEUE_TIME_HEADER: f"{seconds:.6f}"}


def queue_time_comment(seconds: float | None) -> bytes:
    """An SSE comment (clients skip it) that opens a stream: the queue wait, as the header says it."""
    return b"" if seconds is None else f": queue_time={seconds:.6f}\n\n".encode()


async def request_metrics(core, handle) -> dict:
    """Every per-request metric, once its terminal event arrived (see docs/metrics.md)."""
    try:
        history = parse_history(await core.r.lrange(core.names.history(handle.request_id), 0, -1))
    except redis.RedisError as e:  # the answer is ready: it goes out without the lifecycle intervals
        logger.warning("request %s: no history for its metrics (%r)", handle.request_id, e)
        history = []
    end = handle.ended
    return {
        **lifecycle_intervals(history),
        **client_intervals(handle.t0, handle.token_times, len(handle.token_ids), handle.ended_at or handle.t0),
        "prompt_tokens": getattr(end, "prompt_tokens", None),
        "cached_prompt_tokens": getattr(end, "cached_tokens", None),
        "output_tokens": len(handle.token_ids),
        "preemptions": getattr(end, "num_preemptions", None),
    }
