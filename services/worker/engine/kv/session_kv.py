"""The KV of paused conversation sessions: kept in the pool between turns, moved to a second tier under pressure.

A session's turn that finishes keeps a reference on the full blocks it computed (at most `max_blocks`, the
leading ones: a prefix is what the next turn can reuse). They stay registered in the prefix cache, so the next
turn of the session finds them by their hashes as any prefix hit, and nothing else can evict them meanwhile: that
is the whole difference from the plain prefix cache, where a conversation's blocks survive only if nothing else
needed the room. The next turn's admission takes its own references and the session's are dropped (`resumed`).

When the pool runs short (an allocation the scheduler cannot make), paused sessions are reclaimed least recently
used first, before anyone is preempted: a run of at least `swap_min_tokens` tokens is copied to the tier (the
runner's read_slabs, checksummed on disk by kv_tier.DiskTier) and its blocks released; a shorter one, or one the
tier has no room for, is released only (recomputing it costs less than the copy, docs/benchmarks.md). A swapped
session's next turn is swapped back in at admission: blocks allocated, the KV written back, their hashes
registered, so the prompt lookup finds them. A tier entry that fails its checksum is treated as missing: the turn
recomputes, never reads wrong KV.

The same tier serves preemption: a preempted request's computed blocks are parked there (`park`, under
PARKED + its id) and swapped back when it is admitted again, instead of recomputed; its sampler's state lives on
its Sequence, untouched by either, so a seeded sampled output is the same preempted or not (the engine tests).

Every change a worker must record in the session's Redis record (swapped, released) is noted in `events` for
the worker to publish; this module does no I/O besides the tier's files.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path
from dataclasses import dataclass

from services.worker.engine.kv.block_manager import BlockManager
from services.worker.engine.request import Sequence, SequenceStatus
from shared.wire.block_hash import extend_block_hashes
from shared.wire.events import SessionReason

logger = logging.getLogger(__name__)

PARKED = "preempted:"  # key prefix of a preempted request's KV in the tier (never a session key: those hold ':s:')


@dataclass
class Kept:
    """One session's KV on this worker: in the pool (blocks) or in the tier (blocks empty, num_blocks kept)."""

    request_id: str  # the turn that left it: the fence of every move this worker records for it
    hashes: list[bytes]  # the chained hashes of the kept blocks, in order
    blocks: list[int]  # pool blocks referenced by the session ([] once swapped)
    at: float  # monotonic time it was kept or last touched
    swapped: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True)
class SessionEvent:
    session: str
    request_id: str
    what: str  # "swapped" | "released"
    reason: SessionReason


class SessionKV:
    def __init__(self, blocks: BlockManager, runner, tier=None, max_blocks: int = 4096, swap_min_tokens: int = 0):
        self.blocks = blocks
        self.runner = runner
        self.tier = tier  # kv_tier.DiskTier, or None: reclaimed sessions are released only
        self.max_blocks = max_blocks
        self.swap_min_tokens = swap_min_tokens
        self.kept: OrderedDict[str, Kept] = OrderedDict()  # least recently used first
        self.pool_blocks = 0  # pool blocks the kept sessions reference (kept up to date: read every tick)
        self.wanted: dict[str, int] = {}  # session -> its turns in the engine's queue, not yet admitted
        self.events: list[SessionEvent] = []
        self.swap_outs = 0
        self.swap_ins = 0
        self.swap_in_failures = 0

    @classmethod
    def for_config(cls, blocks: BlockManager, runner, config) -> SessionKV:
        """An engine's, from its EngineConfig: with the disk tier when a folder is configured."""
        tier = None
        if config.session_swap_dir:
            from services.worker.engine.kv.kv_tier import DiskTier  # numpy; only where a tier is configured

            tier = DiskTier(Path(config.session_swap_dir), config.session_swap_max_bytes)
        return cls(blocks, runner, tier, config.session_max_blocks, config.session_swap_min_tokens)

    # ---- a turn ends / starts --------------------------------------------------------------------------------
    def keep(self, session: str, seq: Sequence) -> int:
        """Keep the finished turn's computed full blocks for the session (call before its blocks are released).
        -> blocks kept (0: nothing, e.g. no prefix caching, or nothing complete)."""
        self.forget(session)
        if not self.blocks.enable_prefix_caching or self.max_blocks == 0:
            return 0
        n = min(seq.num_registered_blocks, len(seq.block_table), self.max_blocks)
        if n == 0:
            return 0
        run = seq.block_table[:n]
        self.blocks.acquire(run)
        self.kept[session] = Kept(seq.request_id, list(seq.block_hashes[:n]), run, time.monotonic())
        self.pool_blocks += n
        return n

    @staticmethod
    def key_of(seq: Sequence) -> str:
        """Where a sequence being admitted finds KV of its own: parked when it was preempted, else its session's."""
        return PARKED + seq.request_id if seq.status == SequenceStatus.PREEMPTED else seq.session_id

    def can_park(self, seq: Sequence) -> bool:
        """Whether preempting `seq` would park its KV in the tier (one is configured, the KV is worth the copy) rather
        than leave it to be recomputed."""
        n = seq.num_registered_blocks
        return self.tier is not None and n > 0 and n * self.blocks.block_size >= self.swap_min_tokens

    def park(self, seq: Sequence) -> None:
        """A running sequence is being preempted: its computed full blocks go to the tier (when there is one and
        they are worth it), to be swapped back at its readmission. Call before its blocks are released."""
        if not self.can_park(seq):
            return
        n = seq.num_registered_blocks
        key = PARKED + seq.request_id
        try:
            if not self._put(key, list(seq.block_hashes[:n]), seq.block_table[:n]):
                return
        except OSError as e:
            logger.warning("parking the KV of preempted %s failed (%s): it recomputes", seq.request_id, e)
            return
        self.kept[key] = Kept(seq.request_id, list(seq.block_hashes[:n]), [], time.monotonic(), swapped=True)
        self.swap_outs += 1

    def prepare(self, seq: Sequence, key: str) -> bool:
        """Before a sequence's prefix lookup: KV swapped out under `key` (its session's, or its own when it was
        preempted) is swapped back in (when its hashes are the prompt's and the pool has the room), so the lookup
        finds its blocks. -> False when its KV is in the tier and the pool has no room for it yet: admitted now,
        the sequence would take a prefill chunk's few blocks and recompute, in chunks, what a swap-in restores
        for ~1 % of the cost (docs/benchmarks.md), and it needs all those blocks in the end anyway."""
        k = self.kept.get(key)
        if k is None or not k.swapped:
            return True
        extend_block_hashes(seq.token_ids, seq.block_hashes, self.blocks.block_size, seq.num_tokens)
        if seq.block_hashes[: k.num_blocks] != k.hashes:  # another conversation under the same id: recompute
            self._drop_swapped(key)
            return True
        if len(self.blocks.lookup_prefix(k.hashes, k.num_blocks)) == k.num_blocks:
            return True  # still in the pool's cache: nothing to copy back (the tier's copy goes at admission)
        while not self.blocks.can_allocate(k.num_blocks):  # room for all of it, from other paused sessions if need be
            if not self.reclaim(spare=key):
                return False  # the running requests hold the pool
        entry = self.tier.get(key)
        if entry is None or list(entry.block_hashes) != k.hashes:
            self.swap_in_failures += 1
            logger.warning("%s: the swapped KV is missing or corrupt: recomputing", key)
            self._drop_swapped(key)
            return True
        new = self.blocks.allocate(k.num_blocks)
        self.runner.write_blocks(new, entry.payload)
        run = []
        for b, h in zip(new, k.hashes):
            if self.blocks.register(b, h):
                run.append(b)  # allocated: the session holds its one reference
            else:  # that block is in the pool already (another conversation's shared prefix): use it instead
                self.blocks.release([b])
                found = self.blocks.lookup_prefix([h], 1)
                self.blocks.acquire(found)
                run.extend(found)
        self.tier.drop(key)
        k.blocks, k.swapped, k.at = run, False, time.monotonic()
        self.pool_blocks += len(run)
        self.swap_ins += 1
        return True

    def blocks_to_swap_in(self, key: str) -> int:
        """The pool blocks what is swapped out under `key` needs to come back (0: nothing in the tier)."""
        k = self.kept.get(key)
        return k.num_blocks if k is not None and k.swapped else 0

    def resumed(self, session: str) -> None:
        """The sequence kept under `session` was admitted (it holds its own references now): what was kept for it,
        in the pool or the tier, is released."""
        self.forget(session)

    def forget(self, session: str) -> None:
        """Release whatever is kept for the session (closed, replaced by a newer turn's KV)."""
        k = self.kept.pop(session, None)
        if k is None:
            return
        if k.swapped:
            self.tier.drop(session)
        else:
            self.blocks.release(k.blocks)
            self.pool_blocks -= len(k.blocks)

    # ---- pressure and idleness -------------------------------------------------------------------------------
    def reclaim(self, spare: str = "") -> bool:
        """Free the pool blocks of the least recently used paused session (not `spare`), one whose next turn is not
        already waiting here first (its KV would be swapped out only to be swapped back in): swapped to the tier when
        worth it and it fits, else released. -> whether any block was freed."""
        candidates = [s for s, k in self.kept.items() if not k.swapped and s != spare and not s.startswith(PARKED)]
        idle = [s for s in candidates if s not in self.wanted]
        for session in (idle or candidates)[:1]:
            k = self.kept[session]
            tokens = k.num_blocks * self.blocks.block_size
            if self.tier is not None and tokens >= self.swap_min_tokens and self._swap_out(session, k):
                self.events.append(SessionEvent(session, k.request_id, "swapped", SessionReason.PRESSURE))
            else:
                del self.kept[session]
                self.blocks.release(k.blocks)
                self.pool_blocks -= len(k.blocks)
                self.events.append(SessionEvent(session, k.request_id, "released", SessionReason.PRESSURE))
            return True
        return False

    def waiting(self, session: str) -> None:
        """A turn of the session is in the engine's queue: its KV is reclaimed last (until it is admitted)."""
        self.wanted[session] = self.wanted.get(session, 0) + 1

    def admitted(self, session: str) -> None:
        if (n := self.wanted.get(session, 0) - 1) > 0:
            self.wanted[session] = n
        else:
            self.wanted.pop(session, None)

    def _put(self, key: str, hashes: list[bytes], blocks: list[int]) -> bool:
        """The blocks' K/V into the tier under key, streamed a slab at a time (runner.read_slabs)."""
        return self.tier.put_parts(key, hashes, len(blocks) * self.runner.block_bytes, self.runner.read_slabs(blocks))

    def _swap_out(self, session: str, k: Kept) -> bool:
        try:
            if not self._put(session, k.hashes, k.blocks):
                return False
        except OSError as e:  # a full or failing disk: the session is released instead
            logger.warning("session %s: swapping its KV out failed (%s): releasing it", session, e)
            return False
        self.blocks.release(k.blocks)
        self.pool_blocks -= len(k.blocks)
        k.blocks, k.swapped = [], True
        self.kept.move_to_end(session)  # the tier's order is its own; keep the pool's LRU about pool entries
        self.swap_outs += 1
        return True

    def expire(self, idle_s: float, reason: SessionReason = SessionReason.IDLE) -> None:
        """Release every session kept untouched for idle_s (the whole kept set when idle_s is 0: stopping)."""
        now = time.monotonic()
        for session in [s for s, k in self.kept.items() if now - k.at >= idle_s and not s.startswith(PARKED)]:
            k = self.kept[session]
            self.forget(session)
            self.events.append(SessionEvent(session, k.request_id, "released", reason))

    def _drop_swapped(self, session: str) -> None:
        k = self.kept.get(session)
        self.forget(session)
        if k is not None and not session.startswith(PARKED):
            self.events.append(SessionEvent(session, k.request_id, "released", SessionReason.PRESSURE))

    def take_events(self) -> list[SessionEvent]:
        out, self.events = self.events, []
        return out

    # ---- figures ---------------------------------------------------------------------------------------------
    def reclaimable_blocks(self) -> int:
        """Pool blocks paused sessions reference: free for the taking, at the cost of a swap. Counted, not walked
        (the worker reads it every tick); a block a running request shares with a session is counted too, which
        overstates the room by what a session shares with a turn running meanwhile (its own, usually: none)."""
        return self.pool_blocks

    def figures(self) -> dict[str, int]:
        kept = [k for s, k in self.kept.items() if not s.startswith(PARKED)]
        paused = [k for k in kept if not k.swapped]
        swapped = [k for k in kept if k.swapped]
        return {
            "sessions_paused": len(paused),
            "sessions_swapped": len(swapped),
            "session_blocks_paused": sum(k.num_blocks for k in paused),
            "session_blocks_swapped": sum(k.num_blocks for k in swapped),
            "kv_swap_outs": self.swap_outs,
            "kv_swap_ins": self.swap_ins,
        }
