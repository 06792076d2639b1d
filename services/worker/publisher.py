"""Turns one engine step's results into events and lifecycle transitions, in one round trip.

Per step: one token_generated per reply destination (never one message per token), then the
state changes, then each ended request's settlement (FINISHED + completed, or FAILED +
failed), all in one pipeline so their order on every reply stream is the order they happened.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import redis

from shared.constants import EVENT_FIELD, STREAM_MAXLEN, Names, private_stream_ttl
from shared.context_store import ContextStore
from shared.errors import InvalidTransition
from shared.events import Completed, Failed, Scheduled, TokenDelta, TokenGenerated, encode
from shared.lifecycle import Lifecycle, Publish, State
from shared.logprobs import pack as pack_logprobs

logger = logging.getLogger(__name__)

# KEYS: exec layers. The attempt each was placed with (nil: the context is gone).
_ATTEMPTS_LUA = "local out = {} for i, k in ipairs(KEYS) do out[i] = redis.call('HGET', k, 'attempt') end return out"


@dataclass
class Active:
    """The worker's record of a request it holds (built from its Scheduled event)."""

    request_id: str
    reply_to: str
    traceparent: str
    prompt_len: int
    deadline: float
    output_token_ids: list[int] = field(default_factory=list)
    scheduled: Scheduled | None = None  # the placement, kept to hand the request back
    num_preemptions: int = 0
    attempt: int = 1  # placement it holds the request with: the fencing token of every write for it


class StepPublisher:
    def __init__(self, client, names: Names, worker_id: str, lifecycle: Lifecycle, store: ContextStore,
                 token_ttl_s: int):
        self.r = client
        self.token_ttl_s = token_ttl_s  # refreshed by every append: an ended request's list lasts as its context
        self._deferred: list[tuple[str, str]] = []  # scheduling decisions not yet stamped (Redis was away)
        self.names = names
        self.worker_id = worker_id
        self.lifecycle = lifecycle
        self.store = store

    def publish(self, step: int, result, active: dict[str, Active], kv_info) -> set[str]:
        """One MULTI/EXEC: tokens reach the client and the request's token list together or not at all, so a
        request moved to another worker resumes exactly after what its client has. Fenced: the exec layers of
        the step's requests are WATCHed and their attempts checked first, so nothing is written for a request
        that was placed elsewhere since (this worker hung and woke up); those are returned, to be dropped.
        Retried while Redis is away (the engine does not step meanwhile: nothing is lost, generation pauses)."""
        new = {o.request_id: o.new_token_ids for o in result.outputs if o.new_token_ids and o.request_id in active}
        lost: set[str] = set()
        for attempt in itertools.count():
            try:
                lost |= self._publish_once(step, result, active, kv_info, new)
                break
            except redis.WatchError:
                continue  # an exec layer changed between the check and the write: check again
            except (redis.ConnectionError, redis.TimeoutError) as e:
                delay = min(2.0, 0.05 * 2 ** attempt)
                logger.warning("publishing step %d failed (%s); retrying in %.2f s", step, e, delay)
                time.sleep(delay)
        self._deferred = []
        for rid, tokens in new.items():
            if rid not in lost:
                active[rid].output_token_ids.extend(tokens)
        return lost

    def _stale(self, pipe, rids: list[str], active: dict[str, Active]) -> set[str]:
        pipe.watch(*[self.names.layer(rid, "exec") for rid in rids])
        return self.not_owned(pipe, rids, active)

    def not_owned(self, client, rids: list[str], active: dict[str, Active]) -> set[str]:
        """Of rids, those this worker no longer owns (exec.attempt moved on, or the context is gone)."""
        if not rids:
            return set()
        keys = [self.names.layer(rid, "exec") for rid in rids]
        found = client.eval(_ATTEMPTS_LUA, len(keys), *keys)
        return {rid for rid, at in zip(rids, found) if at is None or int(at) != active[rid].attempt}

    def publish_scheduled(self, transitions: list[tuple[str, str]], active: dict[str, Active]) -> None:
        """Stamp the step's scheduling decisions (PREFILLING, PREEMPTED) before its forward pass runs, so
        prefill_time and queue intervals measure what they say."""
        for rid, status in transitions:
            if rid in active and status == "PREEMPTED":
                active[rid].num_preemptions += 1
        pipe = self.r.pipeline(transaction=False)
        queued = self._queue_transitions(pipe, transitions, active)
        if not queued:
            return
        try:
            self._check(pipe.execute(), queued)
        except (redis.ConnectionError, redis.TimeoutError) as e:  # the step's own publish retries them
            logger.warning("stamping scheduling decisions failed (%s); they go with the step's results", e)
            self._deferred.extend(transitions)

    def _queue_transitions(self, pipe, transitions, active, lost=frozenset()) -> list[tuple[str, State]]:
        queued = []
        for rid, status in transitions:
            if rid in active and rid not in lost:
                self.lifecycle.queue(pipe, rid, State(status), fence=active[rid].attempt)
                queued.append((rid, State(status)))
        return queued

    def _publish_once(self, step: int, result, active: dict[str, Active], kv_info, new: dict) -> set[str]:
        touched = sorted({rid for rid, _ in [*self._deferred, *result.transitions] if rid in active} | set(new) |
                         {o.request_id for o in result.outputs if o.finished and o.request_id in active})
        with self.r.pipeline(transaction=True) as pipe:
            lost = self._stale(pipe, touched, active) if touched else set()
            pipe.multi()
            by_reply: dict[str, list[TokenDelta]] = defaultdict(list)
            for out in result.outputs:
                if out.request_id in new and out.request_id not in lost:
                    by_reply[active[out.request_id].reply_to].append(
                        TokenDelta(out.request_id, out.first_index, tuple(out.new_token_ids),
                                   pack_logprobs(out.logprobs) if out.logprobs else None))
            for rid, tokens in new.items():
                if rid not in lost:
                    pipe.rpush(self.names.tokens(rid), *tokens)
                    pipe.expire(self.names.tokens(rid), self.token_ttl_s)
            for reply_to, items in by_reply.items():
                ev = TokenGenerated(worker_id=self.worker_id, step=step, items=tuple(items))
                pipe.xadd(reply_to, {EVENT_FIELD: encode(ev)}, maxlen=STREAM_MAXLEN, approximate=True)
                pipe.expire(reply_to, private_stream_ttl(self.names, reply_to))
            queued = self._queue_transitions(pipe, self._deferred, active, lost)
            for rid, status in result.transitions:
                if rid in active and rid not in lost:
                    if status == "DECODING":
                        self._queue_kv(pipe, rid, kv_info(rid))
                    self.lifecycle.queue(pipe, rid, State(status), fence=active[rid].attempt)
                    queued.append((rid, State(status)))
            for out in result.outputs:
                a = active.get(out.request_id)
                if a is not None and out.finished and a.request_id not in lost:
                    tokens = a.output_token_ids + list(new.get(a.request_id, ()))
                    queued.append((a.request_id, self._queue_end(pipe, a, out, tokens, kv_info(a.request_id))))
            self._check(pipe.execute(), queued)
        return lost

    def _queue_kv(self, pipe, rid: str, info) -> None:
        if info is not None:
            self.store.update(pipe, rid, "kv", {"blocks": info[0], "cached_tokens": info[1]})

    def _queue_end(self, pipe, a: Active, out, tokens: list[int], info) -> State:
        cached = info[1] if info else 0
        if out.error_reason:
            ev = Failed(request_id=a.request_id, reason=out.error_reason, message=out.error or out.error_reason,
                        service="worker", traceparent=a.traceparent)
            self.lifecycle.queue(pipe, a.request_id, State.FAILED, out.error_reason, [Publish(a.reply_to, ev)],
                                 fence=a.attempt)
            return State.FAILED
        self.store.update(pipe, a.request_id, "output", {
            "token_ids": tokens, "finish_reason": out.finish_reason,
            "output_tokens": len(tokens), "num_preemptions": a.num_preemptions})
        ev = Completed(request_id=a.request_id, worker_id=self.worker_id, finish_reason=out.finish_reason or "stop",
                       prompt_tokens=a.prompt_len, output_tokens=len(tokens), cached_tokens=cached,
                       num_preemptions=a.num_preemptions, traceparent=a.traceparent)
        self.lifecycle.queue(pipe, a.request_id, State.FINISHED, out.finish_reason or "stop",
                             [Publish(a.reply_to, ev)], fence=a.attempt)
        return State.FINISHED

    def _check(self, replies: list, queued: list[tuple[str, State]]) -> None:
        """Pipeline replies of the transitions (HSETs interleave; keep only script replies)."""
        scripts = [r for r in replies if isinstance(r, list)]
        for (rid, to), raw in zip(queued, scripts):
            try:
                res = self.lifecycle.interpret(rid, to, raw)
            except InvalidTransition as e:
                logger.warning("%s", e)
                continue
            if not res.applied and to in (State.FINISHED, State.FAILED):
                logger.info("request %s already settled as %s", rid, res.previous)
