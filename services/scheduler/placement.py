"""Which worker a request goes to: a pure policy over candidates (no Redis, no clock), one choice per call.

kv (the default), after NVIDIA Dynamo's KV router and SGLang's cache-aware router:
    cost(worker) = overlap_weight x (prompt blocks it would have to prefill) + (KV blocks it has in use)
the lowest wins. The weight (4 by default) says how much more a block to prefill delays a request than a block
another request holds: prefilling a block is a one-off ~21 ms of step time in the calibrated cost model
(docs/simulated_engine.md) against well under a millisecond per step for a block being decoded; and the load
the scheduler sees is up to a heartbeat old, so the worker that has just served a prefix still looks busy with
it. Weight 1 (Dynamo's default) sent follow-up requests away from their prefix in the tests. A worker's blocks
in use are those its running requests reference plus those reserved for requests in flight to it; cached blocks
nobody references are free, so a shared prefix counts once, however many requests use it. Load-balance guard (SGLang's): when the busiest candidate holds more than balance_abs
requests beyond the idlest and more than balance_rel times as many, the prefix is ignored and the least-loaded
worker wins, so one hot prefix cannot pile everything on one worker.
load: the worker with the largest share of its KV pool free (the placement before KV-aware routing).
round_robin: each worker in turn.
Every mode first keeps the candidates with KV room for what the request must allocate, when there are any.
Ties (equal cost) go to the worker holding fewer requests, then to the next one in turn after the last
choice, so a burst of requests nobody has cached is spread over the workers, not piled on the first.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("kv", "load", "round_robin")


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    matched_blocks: int  # leading prompt blocks it holds in its prefix cache (the KV index)
    used_blocks: int  # KV blocks referenced by its requests, plus those reserved for requests in flight to it
    free_blocks: int  # blocks it could allocate now (after the reservations)
    total_blocks: int  # its KV pool
    requests: int  # requests it holds: running, waiting in its engine, in flight to it


@dataclass(frozen=True)
class Decision:
    worker_id: str
    mode: str
    reason: str  # overlap | load_guard | load | round_robin | group (routing.py: with its n > 1 siblings)
    prompt_blocks: int  # blocks of the prompt (the last one partial) the request has to have
    matched: dict[str, int]  # candidate -> prompt blocks it holds
    costs: dict[str, float]  # candidate -> its cost (kv) or its free share of the pool (load); empty: round_robin

    def new_blocks(self, need_blocks: int) -> int:
        """Blocks the chosen worker must allocate for a request needing need_blocks (its cached ones are there)."""
        return max(0, need_blocks - self.matched.get(self.worker_id, 0))


class Placement:
    def __init__(self, mode: str = "kv", overlap_weight: float = 4.0, balance_abs: int = 16, balance_rel: float = 1.5):
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r} is not one of {MODES}")
        self.mode = mode
        self.overlap_weight = overlap_weight
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._turn = 0  # rotation: ties (and round_robin) start after the last worker chosen

    def choose(self, prompt_blocks: int, need_blocks: int, candidates: list[Candidate]) -> Decision:
        """The worker for a request whose prompt covers prompt_blocks blocks and which needs need_blocks in all
        (prompt + the first generated token). candidates: the workers with a free slot (at least one)."""
        if not candidates:
            raise ValueError("no candidate worker")
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        rank = {c.worker_id: (i - self._turn) % len(ordered) for i, c in enumerate(ordered)}  # ties: in turn
        matched = {c.worker_id: min(c.matched_blocks, prompt_blocks) for c in ordered}
        if self.mode == "round_robin":
            return self._pick(ordered[self._turn % len(ordered)], ordered, "round_robin", prompt_blocks, matched, {})
        roomy = [c for c in ordered if c.free_blocks >= need_blocks - matched[c.worker_id]] or ordered
        if self.mode == "load" or self._imbalanced(ordered):
            costs = {c.worker_id: round(c.free_blocks / max(1, c.total_blocks), 6) for c in roomy}
            best = min(roomy, key=lambda c: (-costs[c.worker_id], c.requests, rank[c.worker_id]))
            reason = "load" if self.mode == "load" else "load_guard"
            return self._pick(best, ordered, reason, prompt_blocks, matched, costs)
        costs = {
            c.worker_id: self.overlap_weight * (prompt_blocks - matched[c.worker_id]) + c.used_blocks for c in roomy
        }
        best = min(roomy, key=lambda c: (costs[c.worker_id], c.requests, rank[c.worker_id]))
        return self._pick(best, ordered, "overlap", prompt_blocks, matched, costs)

    def _imbalanced(self, candidates: list[Candidate]) -> bool:
        loads = [c.requests for c in candidates]
        return self.overloaded(max(loads), min(loads))

    def overloaded(self, load: int, least: int) -> bool:
        """The balance guard: a worker holding `load` requests, where another holds `least`, is too far ahead to
        be chosen for its cache (by the policy or by a session's affinity)."""
        return load - least > self.balance_abs and load > self.balance_rel * least

    def _pick(
        self,
        best: Candidate,
        ordered: list[Candidate],
        reason: str,
        prompt_blocks: int,
        matched: dict[str, int],
        costs: dict[str, float],
    ) -> Decision:
        self._turn = ordered.index(best) + 1
        return Decision(best.worker_id, self.mode, reason, prompt_blocks, matched, costs)
