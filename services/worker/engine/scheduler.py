"""Step scheduling: token budget, decodes first (with their drafts: spec.py), chunked prefill, preemption.

Each step: (1) running sequences get their next tokens, decode-format ones first, then
ongoing prefill chunks; (2) if no one was preempted and slots and budget remain, waiting
sequences are admitted FIFO (preempted ones sit at the front), reusing prefix-cache blocks; the
choices of one n > 1 request (a group) wait while a sibling computes their shared prompt, then reuse it.
When blocks run out the least important running sequence (highest priority number, then
newest) is preempted: its blocks are released, its KV parked in the disk tier where there is one (session_kv.py),
else recomputed at readmission.

First tokens first: a waiting request that has emitted nothing and finds no room may preempt running ones that
have emitted `first_token_preempt_min_tokens` since their admission (none more important than it, each parked in
the tier, queued at the back), and a paused answer waiting for room never holds a first token behind it: the time
to a first token is what a waiting client feels most, and a conversation's next turn (a session) would otherwise
wait for whole answers of others to end. The minimum bounds how often one request is paused (each admission gives
it that many tokens).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from services.worker.engine.sampling import spec
from services.worker.engine.kv.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.sampling.prompt_logprobs import max_cached_tokens
from services.worker.engine.request import Sequence, SequenceStatus
from services.worker.engine.kv.session_kv import PARKED, SessionKV
from shared.wire.block_hash import extend_block_hashes
from shared.wire.events import State

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens to compute)
    transitions: list[tuple[str, State]] = field(default_factory=list)  # (request id, its lifecycle state now)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, sessions: SessionKV | None = None):
        self.config = config
        self.blocks = blocks
        # Paused sessions' KV: reclaimed (swapped or released) before anyone is preempted or made to wait.
        self.sessions = sessions if sessions is not None else SessionKV(blocks, None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Speculative decoding (spec.py): drafts per step and sequence (0: off, or a runner that cannot check them),
        # and the context window the drafts must stay within (the engine's max_len).
        self.spec_tokens = 0
        self.max_len = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.session_id:
            self.sessions.waiting(seq.session_id)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back (finish, failure, abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if seq.session_id and seq.status == SequenceStatus.WAITING:
                self.sessions.admitted(seq.session_id)  # never admitted: no longer waiting either
        self._free_blocks(seq)
        self.sessions.forget(PARKED + seq.request_id)  # what it parked when preempted, if anything

    def _free_blocks(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        room = self._prompt_room()  # of the budget, the most prompt (non-decode) tokens this step computes
        preempted = False
        # decode-format first (one token left to compute), then ongoing prefills; most important first
        order = sorted(self.running, key=lambda s: (self._prefilling(s), s.importance_key))
        drafting = self.spec_tokens > 0 and sum(s.status == SequenceStatus.DECODING for s in order) <= (
            self.config.spec_max_batch
        )
        for seq in order:
            if budget <= 0:  # below 0: a prompt's last chunk overshot it (_chunk)
                break
            if seq not in self.running:  # preempted while making room for a more important one
                continue
            left = seq.num_tokens - seq.num_computed_tokens
            n = 1 if left == 1 else self._chunk(left, min(budget, room))
            if n == 0:  # a prefill chunk (or a recomputation) past the prompt room
                continue
            prompt = n if n > 1 else 0
            seq.draft = self._draft(seq, budget - 1) if drafting and n == 1 else []
            n += len(seq.draft)
            got, budget_back, any_preempted = self._reserve(seq, n, batch)
            budget += budget_back
            preempted = preempted or any_preempted
            if got:
                batch.items.append((seq, n))
                budget -= n
                room -= prompt
        if not preempted:
            self._admit(batch, min(budget, room))
        return batch

    def _prompt_room(self) -> int:
        """The step's budget for prompt tokens: the whole budget, or session_prefill_tokens while a session's turn
        waits for its first token (queued, or its prompt in prefill). Why: a conversation's turns come in bursts (the
        answers of many conversations end together, their users answer within seconds), each a few hundred new
        tokens; in steps half as long, each turn's first token comes at the end of a short step instead of a chunk
        of a long one, and the answers running beside them advance twice as often (docs/benchmarks.md, issue 26).
        Traffic without sessions keeps the whole budget (long prompts prefill fastest in large steps), and so does a
        turn alone in the engine (no one to share the steps with)."""
        cap, whole = self.config.session_prefill_tokens, self.config.max_num_batched_tokens
        if cap == 0 or cap >= whole or len(self.running) + len(self.waiting) < 2:
            return whole
        if self.sessions.wanted or any(
            s.session_id and s.num_outputs == 0 for s in self.running if self._prefilling(s)
        ):
            return cap
        return whole

    def _chunk(self, left: int, room: int) -> int:
        """Of a prompt's `left` tokens still to compute, those this step takes with `room` tokens of budget left: all
        of them when they overshoot the room by at most prefill_overshoot_tokens and a sixteenth of the room, else
        the room. Why: a prompt a few tokens over the budget (a 515-token prompt at 512) otherwise finishes in a
        step of its own, or a step later than the rest of it, and its first token with it: a burst of such prompts
        got every first token a step late (docs/benchmarks.md, issue 29). The sixteenth bounds how much longer a
        step gets for the decodes beside it, and keeps a small budget strict."""
        if room <= 0:
            return 0
        over = min(self.config.prefill_overshoot_tokens, room // 16)
        return left if left <= room + over else room

    @staticmethod
    def _prefilling(seq: Sequence) -> bool:
        return seq.num_tokens - seq.num_computed_tokens > 1

    def _draft(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for seq's step (set on seq.draft for the runner; the engine clears it once checked), within `room`
        tokens of budget and the blocks free now less one per running sequence: a draft never makes anyone wait
        or be preempted."""
        drafts = spec.draft(seq, self.config, room, self.max_len)
        free = self.blocks.num_free_blocks - len(self.running) + len(seq.block_table)
        while drafts and self.blocks.blocks_for(seq.num_computed_tokens + 1 + len(drafts)) > free:
            drafts.pop()
        return drafts

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> tuple[bool, int, bool]:
        """Give `seq` blocks for n more tokens, preempting as needed.

        -> (seq got its blocks, budget returned by un-scheduled victims, anyone preempted).
        """
        need = self.blocks.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
        budget_back, preempted = 0, False
        while need > self.blocks.num_free_blocks:
            if self.sessions.reclaim():
                continue
            victim = max(self.running, key=lambda s: s.importance_key)
            budget_back += self._unschedule(victim, batch)
            self._preempt(victim, batch)
            preempted = True
            if victim is seq:
                return False, budget_back, preempted
        if need > 0:
            seq.block_table.extend(self.blocks.allocate(need))
        return True, budget_back, preempted

    @staticmethod
    def _unschedule(seq: Sequence, batch: ScheduledBatch) -> int:
        """Take `seq` out of this step's batch if it is in it; -> the budget it had."""
        for i, (s, k) in enumerate(batch.items):
            if s is seq:
                del batch.items[i]
                return k
        return 0

    def _preempt(self, seq: Sequence, batch: ScheduledBatch, front: bool = True) -> None:
        self.running.remove(seq)
        seq.draft = []  # un-scheduled: nothing of this step is computed for it
        self.sessions.park(seq)  # with a tier: its KV is swapped back at readmission, not recomputed
        self._free_blocks(seq)
        seq.status = SequenceStatus.PREEMPTED
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.num_preemptions += 1
        batch.transitions.append((seq.request_id, State.PREEMPTED))
        logger.debug("preempted %s (priority %d, %d tokens)", seq.request_id, seq.priority, seq.num_tokens)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        bs = self.blocks.block_size
        held: list[Sequence] = []  # choices waiting for a sibling's prompt blocks: they keep their place in line
        computing = self._prompts_in_prefill()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._held(seq, computing):
                held.append(self.waiting.popleft())
                continue
            if (key := self.sessions.key_of(seq)) and not self.sessions.prepare(seq, key) and self.running:
                if (back := self._preempt_for_first_token(seq, self.sessions.blocks_to_swap_in(key), batch)) >= 0:
                    budget += back
                    continue
                if self._first_token_to_front():
                    continue
                break  # its KV waits in the tier until a running request ends and leaves the room to swap it in
            hits = self._prefix_hits(seq)
            cached = len(hits) * bs
            n = self._chunk(seq.num_tokens - cached, budget)
            need = self.blocks.blocks_for(cached + n) - len(hits)
            if not self.blocks.can_allocate(need, hits):
                if self.sessions.reclaim(spare=key or ""):
                    continue  # a paused session gave its blocks back: try again
                if (back := self._preempt_for_first_token(seq, need, batch, hits)) >= 0:
                    budget += back
                    continue
                if self._first_token_to_front():
                    continue
                break  # head of line waits for blocks
            self._start_prefill(seq, hits, need, key)
            batch.transitions.append((seq.request_id, State.PREFILLING))
            batch.items.append((seq, n))
            budget -= n
            self._note_prefill(seq, computing)
        self.waiting.extendleft(reversed(held))

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """The pool blocks already holding seq's leading full blocks (prefix caching), never the block of its last
        token: that token must be computed to get the next token's logits."""
        if not self.blocks.enable_prefix_caching:
            return []
        bs = self.blocks.block_size
        extend_block_hashes(seq.token_ids, seq.block_hashes, bs, seq.num_tokens)
        limit = (seq.num_tokens - 1) // bs
        if (cap := max_cached_tokens(seq)) is not None:  # it needs those positions' logits computed
            limit = min(limit, cap // bs)
        return self.blocks.lookup_prefix(seq.block_hashes, limit)

    def _start_prefill(self, seq: Sequence, hits: list[int], need: int, key: str) -> None:
        """The head of the line moves to running: its cached blocks held, `need` more allocated."""
        cached = len(hits) * self.blocks.block_size
        self.blocks.acquire(hits)
        if key:
            self.sessions.resumed(key)
        if seq.session_id and seq.status == SequenceStatus.WAITING:
            self.sessions.admitted(seq.session_id)
        self.blocks.record_query(seq.num_tokens, cached)
        seq.block_table = hits + self.blocks.allocate(need)
        seq.num_computed_tokens = cached
        if seq.status == SequenceStatus.WAITING:
            # What the request reused: its first admission's hits, prompt tokens only. After a preemption
            # it finds its own blocks again (outputs too): recomputation saved, not a reuse to report.
            seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
        seq.num_registered_blocks = len(hits)
        seq.admitted_tokens = seq.num_tokens
        self.waiting.popleft()
        self.running.append(seq)
        seq.status = SequenceStatus.PREFILLING

    def _preempt_for_first_token(
        self, seq: Sequence, need: int, batch: ScheduledBatch, hits: list[int] | None = None
    ) -> int:
        """Make room for `need` blocks (with `hits` acquired) for a waiting `seq` that has emitted nothing, by
        preempting running requests that have had their share since admission (module docstring), least important
        first, each parked in the tier and queued at the back. Nobody is preempted unless together they free the
        room. -> the budget given back by un-scheduled victims, or -1 when no room was made."""
        least = self.config.first_token_preempt_min_tokens
        if least == 0 or seq.num_outputs > 0:
            return -1
        victims = sorted(
            (
                s
                for s in self.running
                if s.status == SequenceStatus.DECODING
                and s.num_tokens - s.admitted_tokens >= least
                and s.priority >= seq.priority
                and self.sessions.can_park(s)
            ),
            key=lambda s: s.importance_key,
            reverse=True,
        )
        if not victims or self.blocks.num_free_blocks + sum(len(v.block_table) for v in victims) < need:
            return -1  # (blocks a victim shares with others free nothing: then the loop below stops short)
        back = 0
        for victim in victims:
            if self.blocks.can_allocate(need, hits or ()):
                break
            back += self._unschedule(victim, batch)
            self._preempt(victim, batch, front=False)
        logger.debug("%s: first token first, %d running left", seq.request_id, len(self.running))
        return back

    def _first_token_to_front(self) -> bool:
        """The head of the queue has emitted tokens (a preempted request) and waits for room: the first waiting
        request that has emitted nothing goes before it, to be admitted, or to preempt for its first token, in its
        stead (a first token is never held behind a paused answer). -> whether one moved."""
        if self.config.first_token_preempt_min_tokens == 0 or self.waiting[0].num_outputs == 0:
            return False
        fresh = next((s for s in self.waiting if s.num_outputs == 0), None)
        if fresh is None:
            return False
        self.waiting.remove(fresh)
        self.waiting.appendleft(fresh)
        return True

    def _prompts_in_prefill(self) -> dict[str, int]:
        """group -> the fewest prompt blocks registered so far by a running sibling still computing the prompt."""
        computing: dict[str, int] = {}
        for seq in self.running:
            self._note_prefill(seq, computing)
        return computing

    @staticmethod
    def _note_prefill(seq: Sequence, computing: dict[str, int]) -> None:
        if seq.group_id and seq.num_computed_tokens < seq.num_prompt_tokens:
            computing[seq.group_id] = min(
                computing.get(seq.group_id, seq.num_registered_blocks), seq.num_registered_blocks
            )

    def _held(self, seq: Sequence, computing: dict[str, int]) -> bool:
        """Whether a running sibling (same group: the choices of one n > 1 request, one prompt) is still computing
        prompt blocks `seq` could reuse. Admitted now, `seq` would find them uncached and compute them again;
        held until they are registered, it gets them as prefix-cache hits, so the prompt is computed once."""
        if not seq.group_id or not self.blocks.enable_prefix_caching or max_cached_tokens(seq) is not None:
            return False  # (one owing prompt log probabilities computes the prompt itself: it would not reuse it)
        shared = min(seq.num_prompt_tokens, seq.num_tokens - 1) // self.blocks.block_size
        return computing.get(seq.group_id, shared) < shared

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks to the prefix cache."""
        if not self.blocks.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.blocks.block_size
        if full <= seq.num_registered_blocks:
            return
        extend_block_hashes(seq.token_ids, seq.block_hashes, self.blocks.block_size, seq.num_computed_tokens)
        for i in range(seq.num_registered_blocks, full):
            self.blocks.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = full
