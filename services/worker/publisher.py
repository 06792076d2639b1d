"""Turns one engine step's results into events and lifecycle transitions.

Per step: one token_generated per reply destination (never one message per token), then the
state changes, then each ended request's settlement (FINISHED + completed, or FAILED +
failed), in that order on every reply stream. On a single Redis a step that only adds tokens is one
script, one with state changes one MULTI/EXEC (_publish_transaction); on a Redis Cluster one pipeline of
fenced writes, then the reply events (_publish_fenced). Their scripts: publish_scripts.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import redis

from services.worker.publish_scripts import APPEND_LUA, ATTEMPTS_LUA, FENCED, TOKENS_LUA
from shared.process.backoff import backoff_s
from shared.wire.bus import event_argv, write_event
from shared.wire.constants import Names
from shared.redis_io.redis_client import TRANSIENT_ERRORS
from shared.state.context_store import ContextStore
from shared.wire.errors import FatalError
from shared.wire.events import Completed, Failed, PromptLogprobs, Scheduled, TokenDelta, TokenGenerated
from shared.state.lifecycle import Lifecycle, Publish, State
from shared.wire.logprobs import pack as pack_logprobs
from shared.wire.logprobs import pack_prompt
from shared.redis_io.replies import as_text

logger = logging.getLogger(__name__)

REFUSED_FOR_S = 120.0  # error replies to a step's writes for this long end the process (see publish)


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
    state: State = State.SCHEDULED  # its state as this worker last moved it (what a TimedOut it sends says)
    session: str = ""  # its conversation session's key ("" = none)


class StepPublisher:
    def __init__(
        self, client, names: Names, worker_id: str, lifecycle: Lifecycle, store: ContextStore, token_ttl_s: int
    ):
        self.r = client
        self.token_ttl_s = token_ttl_s  # refreshed by every append: an ended request's list lasts as its context
        self._deferred: list[tuple[str, State]] = []  # scheduling decisions not yet stamped (Redis was away)
        self.names = names
        self.worker_id = worker_id
        self.lifecycle = lifecycle
        self.store = store
        self._append = client.register_script(APPEND_LUA)
        self._tokens = client.register_script(TOKENS_LUA)
        self._behind: dict[str, int] = {}  # request id -> length of its tokens list, when short (see APPEND_LUA)

    def publish(self, step: int, result, active: dict[str, Active], kv_info) -> set[str]:
        """Publish the step. On a single Redis one script or one MULTI/EXEC: tokens reach the client and the
        request's token list together or not at all, so a request moved to another worker resumes exactly after
        what its client has. Fenced: nothing is written for a request that was placed elsewhere since (this worker
        hung and woke up); those are returned, to be dropped. Retried while Redis is away (the engine does not step
        meanwhile: nothing is lost, generation pauses)."""
        new = {o.request_id: o.new_token_ids for o in result.outputs if o.new_token_ids and o.request_id in active}
        refused_since = None
        for attempt in itertools.count():
            try:
                lost = self._publish_once(step, result, active, kv_info, new)
                break
            except redis.WatchError:
                continue  # an exec layer changed between the check and the write: check again
            except (*TRANSIENT_ERRORS, redis.ResponseError) as e:
                # An error reply (OOM under noeviction, READONLY during a promotion, EXECABORT) refused the step
                # like Redis being away does: nothing of a MULTI/EXEC was made, and the fenced path's writes are
                # idempotent. Given up, the step's tokens and endings would be lost (finished requests left
                # hanging, later tokens appended at the wrong index), so it is retried; an error reply for this
                # long is no passing state: the process exits and is restarted, its requests resumed elsewhere.
                if not isinstance(e, TRANSIENT_ERRORS):
                    refused_since = refused_since or time.monotonic()
                    if time.monotonic() - refused_since > REFUSED_FOR_S:
                        raise FatalError(f"Redis refused step {step}'s writes for {REFUSED_FOR_S:.0f} s: {e}") from e
                delay = backoff_s(attempt)
                logger.warning("publishing step %d failed (%s); retrying in %.2f s", step, e, delay)
                time.sleep(delay)
        self._deferred = []
        for rid in [rid for rid in self._behind if rid not in active or rid in lost]:
            del self._behind[rid]
        for rid, tokens in new.items():
            if rid not in lost:
                active[rid].output_token_ids.extend(tokens)
        return lost

    def _stale(self, pipe, rids: list[str], active: dict[str, Active]) -> set[str]:
        pipe.watch(*[self.names.layer(rid, "exec") for rid in rids])
        return self.not_owned(pipe, rids, active)

    def not_owned(self, client, rids: list[str], active: dict[str, Active]) -> set[str]:
        """Of rids, those this worker no longer owns (exec.attempt moved on, or the context is gone). One script
        per hash slot (one on a single Redis)."""
        found: dict[str, object] = {}
        for group in self._by_slot(rids):
            keys = [self.names.layer(rid, "exec") for rid in group]
            # execute_command, not eval(): a cluster pipeline refuses eval(), but runs a command while WATCHing
            found.update(zip(group, client.execute_command("EVAL", ATTEMPTS_LUA, len(keys), *keys)))
        return {rid for rid, at in found.items() if at is None or int(at) != active[rid].attempt}

    def _by_slot(self, rids: list[str]) -> list[list[str]]:
        """rids grouped by their partition's hash slot: all together on a single Redis."""
        if not self.names.cluster:
            return [rids] if rids else []
        groups: dict[int, list[str]] = defaultdict(list)
        for rid in rids:
            groups[self.names.partition(rid)].append(rid)
        return list(groups.values())

    def publish_scheduled(self, transitions: list[tuple[str, State]], active: dict[str, Active]) -> None:
        """Stamp the step's scheduling decisions (PREFILLING, PREEMPTED) before its forward pass runs, so
        prefill_time and queue intervals measure what they say."""
        for rid, status in transitions:
            if rid in active and status is State.PREEMPTED:
                active[rid].num_preemptions += 1
        pipe = self.r.pipeline(transaction=False)
        queued = self._queue_transitions(pipe, transitions, active)
        if not queued:
            return
        try:
            self._check(pipe.execute(), [(rid, to, ()) for rid, to in queued], active)
        except (*TRANSIENT_ERRORS, redis.ResponseError) as e:  # the step's own publish retries them (see publish)
            logger.warning("stamping scheduling decisions failed (%s); they go with the step's results", e)
            self._deferred.extend(transitions)

    def _queue_transitions(self, pipe, transitions, active, lost=frozenset()) -> list[tuple[str, State]]:
        queued = []
        for rid, status in transitions:
            if rid in active and rid not in lost:
                self.lifecycle.queue(pipe, rid, status, fence=active[rid].attempt)
                queued.append((rid, status))
        return queued

    def _publish_once(self, step: int, result, active: dict[str, Active], kv_info, new: dict) -> set[str]:
        touched = sorted(
            {rid for rid, _ in [*self._deferred, *result.transitions] if rid in active}
            | set(new)
            | {o.request_id for o in result.outputs if o.finished and o.request_id in active}
        )
        if not touched:
            return set()
        if self.names.cluster:
            return self._publish_fenced(step, result, active, kv_info, new, touched)
        return self._publish_transaction(step, result, active, kv_info, new, touched)

    def _publish_transaction(
        self, step: int, result, active: dict[str, Active], kv_info, new: dict, touched: list[str]
    ) -> set[str]:
        """A single Redis. A step that only adds tokens (most of them): TOKENS_LUA, one round trip. A step that
        moves states too: one MULTI/EXEC WATCHing the exec layers, the same script first, then the transitions."""
        if not (self._deferred or result.transitions or any(o.finished for o in result.outputs)):
            return self._publish_tokens(step, result, active, new, touched)
        with self.r.pipeline(transaction=True) as pipe:
            lost = self._stale(pipe, touched, active)
            pipe.multi()
            rids = [rid for rid in touched if rid in new and rid not in lost]
            keys, args = self._tokens_args(step, result, active, new, rids, lost)
            self._tokens(keys=keys, args=args, client=pipe)
            queued = self._queue_step(pipe, result, active, new, kv_info, set(touched) - lost)
            replies = pipe.execute()
        self._note_tokens(rids, replies[0])
        self._check(replies[1:], queued, active)
        return lost

    def _publish_tokens(self, step: int, result, active: dict[str, Active], new: dict, touched: list[str]) -> set:
        lost: set[str] = set()
        while True:
            rids = [rid for rid in touched if rid in new and rid not in lost]
            keys, args = self._tokens_args(step, result, active, new, rids, lost)
            reply = self._tokens(keys=keys, args=args)
            if as_text(reply[0]) == "ok":
                self._note_tokens(rids, reply)
                return lost
            lost |= {rids[i - 1] for i in reply[1:]}  # placed elsewhere since: left out, the rest sent again

    def _tokens_args(self, step: int, result, active: dict[str, Active], new: dict, rids, lost) -> tuple[list, list]:
        first = {o.request_id: o.first_index for o in result.outputs}
        keys: list = []
        args: list = [len(rids), self.token_ttl_s]
        for rid in rids:
            at, tokens = self._from(rid, first[rid], new[rid], active[rid])
            keys += [self.names.tokens(rid), self.names.layer(rid, "exec")]
            args += [active[rid].attempt, at, len(tokens), *tokens]
        for reply_to, ev in self._token_events(step, result, active, new, lost):
            keys.append(reply_to)
            args += event_argv(self.names, reply_to, ev)
        return keys, args

    def _note_tokens(self, rids: list[str], reply: list) -> None:
        short = dict(zip(reply[1::2], reply[2::2]))  # position -> the list's length
        self._note_behind(rids, [short.get(i, -1) for i in range(1, len(rids) + 1)])

    def _publish_fenced(
        self, step: int, result, active: dict[str, Active], kv_info, new: dict, touched: list[str]
    ) -> set[str]:
        """A Redis Cluster: a transaction cannot span hash slots, and one per partition would cost three round trips
        each (WATCH, the attempts, MULTI/EXEC), one after the other. Instead every write carries the attempt it is
        made with and is refused inside its script when exec.attempt moved on (the tokens append, the layer
        writes, the transitions): one pipeline for all partitions, one round trip per master. The reply events
        follow, for the requests still held (at least once: a worker dying in between leaves its tokens in the
        tokens lists, where the gateway finds what its stream missed). Each write checks the attempt on its own:
        a placement landing between two writes of this pipeline (the scheduler gave up on this worker within
        that millisecond) leaves the earlier ones made; the request is returned as lost all the same."""
        pipe = self.r.pipeline(transaction=False)
        appended = self._queue_appends(pipe, result, active, new, touched)
        queued = self._queue_step(pipe, result, active, new, kv_info, set(touched))
        replies = pipe.execute()
        lost = {rid for rid, n in zip(appended, replies) if n == FENCED}
        self._note_behind(appended, replies[: len(appended)])
        later = self._check(replies[len(appended) :], queued, active, lost)
        pipe = self.r.pipeline(transaction=False)
        self._queue_tokens(pipe, step, result, active, new, lost)
        self.lifecycle.complete(self.r, later, pipe)
        return lost

    def _queue_appends(self, pipe, result, active: dict[str, Active], new: dict, rids) -> list[str]:
        """Queue the tokens appends of these requests (first in the pipeline: their replies come first)."""
        first = {o.request_id: o.first_index for o in result.outputs}
        appended = [rid for rid in rids if rid in new]
        for rid in appended:
            self._queue_append(pipe, rid, first[rid], new[rid], active[rid])
        return appended

    def _queue_append(self, pipe, rid: str, at: int, tokens, a: Active) -> None:
        """Append the step's tokens to the request's list (first in the pipeline: its reply comes first)."""
        at, tokens = self._from(rid, at, tokens, a)
        self._append(
            keys=[self.names.tokens(rid), self.names.layer(rid, "exec")],
            args=[a.attempt, at, *tokens, self.token_ttl_s],
            client=pipe,
        )

    def _from(self, rid: str, at: int, tokens, a: Active) -> tuple[int, list[int]]:
        """Where the step's tokens go in the request's list, and which: from where the list stopped when it is
        known to be short (a failover lost its tail)."""
        if (n := self._behind.get(rid)) is not None and n < at:
            return n, [*a.output_token_ids[n:], *tokens]
        return at, list(tokens)

    def _fence(self, a: Active) -> int | None:
        """The attempt a write checks in its script: on a cluster (_publish_fenced); a single Redis's transaction
        WATCHes the exec layers instead (no check per write: one command less per token)."""
        return a.attempt if self.names.cluster else None

    def _note_behind(self, rids: list[str], replies: list) -> None:
        for rid, n in zip(rids, replies):
            if n == FENCED:
                continue
            if n >= 0:
                logger.error(
                    "request %s: its tokens list has %d tokens, fewer than sent before (lost in a "
                    "failover): sending them again",
                    rid,
                    n,
                )
                self._behind[rid] = n
            else:
                self._behind.pop(rid, None)

    def _queue_tokens(self, pipe, step: int, result, active: dict[str, Active], new: dict, lost: set[str]) -> None:
        for reply_to, ev in self._token_events(step, result, active, new, lost):
            write_event(pipe, self.names, reply_to, ev)

    def _token_events(self, step: int, result, active: dict[str, Active], new: dict, lost) -> list:
        """One token_generated per reply stream for the step's new tokens, in output order: [(stream, event)]."""
        by_reply: dict[str, list[TokenDelta]] = defaultdict(list)
        for out in result.outputs:
            if out.request_id in new and out.request_id not in lost:
                by_reply[active[out.request_id].reply_to].append(
                    TokenDelta(
                        out.request_id,
                        out.first_index,
                        tuple(out.new_token_ids),
                        pack_logprobs(out.logprobs) if out.logprobs else None,
                        _prompt(out, active[out.request_id]),
                    )
                )
        return [
            (reply_to, TokenGenerated(worker_id=self.worker_id, step=step, items=tuple(items)))
            for reply_to, items in by_reply.items()
        ]

    def _queue_step(self, pipe, result, active: dict[str, Active], new: dict, kv_info, mine: set[str]) -> list:
        """The step's transitions of the requests in `mine` (deferred scheduling decisions, the step's own, then
        the endings): [(request id, target state, events to publish after it)]."""
        queued = [
            (rid, to, ())
            for rid, to in self._queue_transitions(
                pipe, [(rid, st) for rid, st in self._deferred if rid in mine], active
            )
        ]
        for rid, status in result.transitions:
            if rid in active and rid in mine:
                if status is State.DECODING:
                    self._queue_kv(pipe, rid, kv_info(rid), self._fence(active[rid]))
                self.lifecycle.queue(pipe, rid, status, fence=active[rid].attempt)
                queued.append((rid, status, ()))
        for out in result.outputs:
            a = active.get(out.request_id)
            if a is not None and out.finished and a.request_id in mine:
                tokens = a.output_token_ids + list(new.get(a.request_id, ()))
                queued.append((a.request_id, *self._queue_end(pipe, a, out, tokens, kv_info(a.request_id))))
        return queued

    def _queue_kv(self, pipe, rid: str, info, fence: int | None) -> None:
        if info is not None:
            self.store.update(pipe, rid, "kv", {"blocks": info[0], "cached_tokens": info[1]}, fence=fence)

    def _queue_end(self, pipe, a: Active, out, tokens: list[int], info) -> tuple[State, tuple[Publish, ...]]:
        cached = info[1] if info else 0
        if out.error_reason:
            ev = Failed(
                request_id=a.request_id,
                reason=out.error_reason,
                message=out.error or out.error_reason,
                service="worker",
                traceparent=a.traceparent,
            )
            return State.FAILED, self.lifecycle.queue(
                pipe, a.request_id, State.FAILED, out.error_reason, [Publish(a.reply_to, ev)], fence=a.attempt
            )
        self.store.update(
            pipe,
            a.request_id,
            "output",
            {
                "token_ids": tokens,
                "finish_reason": out.finish_reason,
                "output_tokens": len(tokens),
                "num_preemptions": a.num_preemptions,
            },
            fence=self._fence(a),
        )
        ev = Completed(
            request_id=a.request_id,
            worker_id=self.worker_id,
            finish_reason=out.finish_reason or "stop",
            prompt_tokens=a.prompt_len,
            output_tokens=len(tokens),
            cached_tokens=cached,
            num_preemptions=a.num_preemptions,
            session_blocks=out.session_blocks,
            traceparent=a.traceparent,
        )
        return State.FINISHED, self.lifecycle.queue(
            pipe, a.request_id, State.FINISHED, out.finish_reason or "stop", [Publish(a.reply_to, ev)], fence=a.attempt
        )

    def _check(self, replies: list, queued: list, active: dict[str, Active], fenced: set[str] | None = None) -> list:
        """Pipeline replies of the transitions (layer writes interleave; keep only the transitions' replies, the
        lists). queued: (request id, target state, events to publish after it). Returns (result, those events) of
        the applied ones, noting each one's state in `active`; adds the requests whose transition was fenced to
        `fenced`."""
        scripts = [r for r in replies if isinstance(r, list)]
        done = []
        for (rid, to, later), raw in zip(queued, scripts):
            res = self.lifecycle.interpret(rid, to, raw)
            if res.refused:  # the engine's move does not fit the request's state: logged, never fatal
                logger.warning("request %s: %s -> %s is not allowed", rid, res.previous.value, to.value)
                continue
            if res.fenced and fenced is not None:
                fenced.add(rid)
            if res.applied:
                done.append((res, later))
                if (a := active.get(rid)) is not None:
                    a.state = to
            elif to in (State.FINISHED, State.FAILED):
                logger.info("request %s already settled as %s", rid, res.previous)
        return done


def _prompt(out, a: Active) -> PromptLogprobs | None:
    """The request's prompt log probabilities, with its first token (the engine hands them out once)."""
    if out.prompt_logprobs is None or a.scheduled is None:
        return None
    ev = a.scheduled
    return pack_prompt(ev.prompt_token_ids, out.prompt_logprobs, ev.sampling.prompt_logprobs or 0)
