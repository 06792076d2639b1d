"""KV-cache-aware routing in the scheduler: the KV index fed from the workers' events, and the placement policy
fed from the index and the scheduler's worker views. The index and the policy are pure (kv_index.py,
placement.py); this module holds what joins them to the scheduler: decoding stream entries, asking a worker to
announce its cache again (at most once per liveness TTL), and the candidates' figures.

Placement costs no extra Redis round trip: the KV events come with the heartbeats (one XREAD of both streams a
tick), the decision is written with the placement's other records (same pipeline). Per request it is one walk
over the prompt's block hashes (the index) and one pass over the workers (the policy).
"""

from __future__ import annotations

import logging
import time

from services.scheduler.affinity import GroupAffinity
from services.scheduler.kv_index import KvIndex
from services.scheduler.placement import Candidate, Decision, Placement
from services.scheduler.state import WorkerView
from shared.wire.bus import plain_events
from shared.wire.events import KvEvents, KvResyncRequested
from shared.settings import SchedulerSettings

logger = logging.getLogger(__name__)

READ_COUNT = 1000  # entries of each stream one tick reads


class Router:
    def __init__(self, settings: SchedulerSettings):
        self.policy = Placement(
            settings.routing,
            settings.routing_overlap_weight,
            settings.routing_balance_abs,
            settings.routing_balance_rel,
        )
        self.index = KvIndex()
        self.groups = GroupAffinity()  # the choices of one n > 1 request: on one worker
        self.cursor = "0-0"  # a (re)started scheduler replays what the capped stream still holds
        self.ask_every_s = settings.liveness_ttl_s
        self._asked: dict[str, float] = {}  # worker -> when it was last asked to announce its cache
        self._unknown_since: dict[str, float] = {}  # worker with entries but no heartbeat -> since when

    def on_entries(self, entries) -> None:
        for entry_id, ev in plain_events(entries, "KV event"):
            self.cursor = entry_id
            if isinstance(ev, KvEvents):
                self.index.apply(ev)

    def resyncs(self, workers: dict[str, WorkerView], caught_up: bool) -> list[KvResyncRequested]:
        """After a read: check the workers' heartbeats against the index (only when the stream was read to its
        end) and ask the lagging ones that are known and alive to announce their cache (throttled)."""
        if caught_up:
            for w in workers.values():
                if w.hb is not None:
                    self.index.check_heartbeat(w.worker_id, w.hb.kv_incarnation, w.hb.kv_seq)
        now, out = time.monotonic(), []
        for wid, why in self.index.lagging.items():
            if wid in workers and now - self._asked.get(wid, float("-inf")) >= self.ask_every_s:
                self._asked[wid] = now
                out.append(KvResyncRequested(worker_id=wid, reason=why))
        return out

    def drop_worker(self, worker_id: str) -> None:
        self.index.drop_worker(worker_id)
        self.groups.drop_worker(worker_id)
        self._asked.pop(worker_id, None)
        self._unknown_since.pop(worker_id, None)

    def prune(self, known: set[str]) -> None:
        """Drop the entries of workers the scheduler has not heard from for a liveness TTL: a restarted scheduler
        replays the events of workers that died before it started (no heartbeat will ever declare them dead)."""
        now = time.monotonic()
        for wid in list(self.index.holders) + list(self.index.lagging):
            if wid in known:
                self._unknown_since.pop(wid, None)
            elif now - self._unknown_since.setdefault(wid, now) > self.ask_every_s:
                self.drop_worker(wid)

    def choose(self, q, fits: list[WorkerView], need_blocks: int, block_size: int) -> Decision:
        """The worker for queued request q among fits (live, with a free slot)."""
        ev = q.event
        num_tokens = len(ev.prompt_token_ids) + len(q.output_token_ids)
        decision = (
            self._with_group(q, fits, num_tokens, block_size)
            or self._with_session(q, fits, num_tokens, block_size)
            or self._route(q, fits, num_tokens, need_blocks, block_size)
        )
        self.groups.placed(ev.group_id, ev.group_size, decision.worker_id)
        return decision

    def _with_group(self, q, fits: list[WorkerView], num_tokens: int, block_size: int) -> Decision | None:
        """A choice of an n > 1 request goes where its group's first choice went, if that worker has a slot: the
        prompt blocks are computed there (or being computed), so it needs only the rest of its own."""
        wid = self.groups.worker_for(q.event.group_id)
        if wid is None or all(w.worker_id != wid for w in fits):
            return None
        shared = min(len(q.event.prompt_token_ids), num_tokens - 1) // block_size
        return Decision(wid, self.policy.mode, "group", -(-num_tokens // block_size), {wid: shared}, {})

    def _with_session(self, q, fits: list[WorkerView], num_tokens: int, block_size: int) -> Decision | None:
        """A conversation session's turn goes to the worker that kept its KV (it prefills only the new tokens
        there), unless that worker is gone, has no slot (it is not in fits), or is loaded past the balance guard the
        KV-aware policy applies: then the policy places it as any request, and it recomputes what it must."""
        wid = q.event.session_worker
        mine = next((w for w in fits if w.worker_id == wid), None) if wid else None
        if mine is None:
            return None
        load = {w.worker_id: w.hb.num_running + w.hb.num_waiting + len(w.inflight) for w in fits}
        if self.policy.overloaded(load[wid], min(load.values())):
            return None
        kept = (num_tokens - 1) // block_size
        return Decision(wid, self.policy.mode, "session", -(-num_tokens // block_size), {wid: kept}, {})

    def _route(self, q, fits: list[WorkerView], num_tokens: int, need_blocks: int, block_size: int) -> Decision:
        ev = q.event
        matched = {}
        if self.policy.mode == "kv" and ev.block_size == block_size:
            # The engine computes the block holding the last token whatever it has cached (its logits are needed).
            usable = (num_tokens - 1) // block_size
            matched = self.index.match(ev.block_hashes[:usable])
        cands = [
            Candidate(
                w.worker_id,
                matched.get(w.worker_id, 0),
                w.hb.total_blocks - w.free_blocks(),
                w.free_blocks(),
                w.hb.total_blocks,
                w.hb.num_running + w.hb.num_waiting + len(w.inflight),
            )
            for w in fits
        ]
        return self.policy.choose(-(-num_tokens // block_size), need_blocks, cands)


def decision_fields(d: Decision) -> dict:
    """The placement decision as recorded in the request's exec layer."""
    return {
        "routing": d.mode,
        "routing_reason": d.reason,
        "prompt_blocks": d.prompt_blocks,
        "matched_blocks": d.matched,
    }
