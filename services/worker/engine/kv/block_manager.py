"""Block pool of the paged KV cache: allocation, reference counts and the prefix cache.

Invariants (checked by `check_no_leak` when nothing runs):
  * every block is in exactly one place: referenced (ref > 0), `_free` (ref 0, no hash) or
    `_evictable` (ref 0, holds a registered hash, LRU order: oldest first);
  * `_by_hash[h] == b` iff `_hash[b] == h`; a hash names one block only.
A cached block is evicted (its hash dropped) only when an allocation finds `_free` empty.

With `track_kv_events` on (a worker serving a cluster), every hash registered or evicted is noted until
`take_kv_events` collects it: the worker publishes them as KV events, the scheduler's index of which worker
holds which block is built from them. Off (the engine alone), nothing is noted: nobody would collect it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from services.worker.engine.errors import BlockPoolExhausted


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self.track_kv_events = False
        # Net changes since the last take_kv_events (disjoint: a hash stored then evicted is only "removed").
        self._stored: dict[bytes, None] = {}
        self._removed: dict[bytes, None] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, hashes: Seq[bytes], max_blocks: int) -> list[int]:
        """Blocks caching the longest run of leading `hashes` (at most max_blocks). No ref change."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for h in hashes[:max_blocks]:
            b = self._by_hash.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def can_allocate(self, num_new: int, reused: Seq[int] = ()) -> bool:
        """Whether `num_new` fresh blocks fit after taking `reused` (cached hits) off the pool."""
        taken = sum(1 for b in reused if self._ref[b] == 0)
        return self.num_free_blocks - taken >= num_new

    def acquire(self, block_ids: Seq[int]) -> None:
        """Add a reference to cached blocks (prefix hits)."""
        for b in block_ids:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise BlockPoolExhausted(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # room is needed: evict the least recently used cached block
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash[b]]
                self._note(self._hash[b], self._removed, self._stored)
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        # In address order: a sequence's positions then lie in ascending memory, run after run, which the decode
        # kernel streams fastest (benchmarks/decode_attention: 24-25 GB/s ascending, 19 descending, 16-17 scattered).
        # The pool hands blocks out in eviction order, descending within each run after release's tail-first order;
        # which blocks are taken does not change, only which position gets which.
        out.sort()
        return out

    def release(self, block_ids: Seq[int]) -> None:
        """Drop one reference from each block. Tail blocks first, so they are evicted first."""
        for b in reversed(block_ids):
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise BlockPoolExhausted(f"block {b} released more often than referenced")
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Make a computed full block findable by its hash (first writer wins on duplicates). -> whether it now is
        (False: caching is off, the block has a hash already, or another block holds this one)."""
        if not self.enable_prefix_caching or self._hash[block_id] is not None or block_hash in self._by_hash:
            return False
        self._hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        self._note(block_hash, self._stored, self._removed)
        return True

    def refs(self, block_id: int) -> int:
        return self._ref[block_id]

    def _note(self, block_hash: bytes, into: dict, out_of: dict) -> None:
        if self.track_kv_events:
            out_of.pop(block_hash, None)
            into[block_hash] = None

    def take_kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes stored, hashes removed) since the last call, netted: each hash in one of them at most."""
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        return stored, removed

    def cached_hashes(self) -> list[bytes]:
        """Every hash findable in the prefix cache now (a full announcement of what this pool holds)."""
        return list(self._by_hash)

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def check_no_leak(self) -> None:
        held = {b: r for b, r in enumerate(self._ref) if r != 0}
        assert not held, f"KV blocks still referenced: {dict(list(held.items())[:20])} ({len(held)} blocks)"
        placed = len(self._free) + len(self._evictable)
        assert placed == self.num_blocks, f"{self.num_blocks - placed} KV blocks are neither free nor cached"
        stale = [b for b in self._evictable if self._hash[b] is None]
        assert not stale, f"evictable blocks without a hash: {stale[:20]}"
