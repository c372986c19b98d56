"""The KV block allocator: free list, reference counts, prefix cache with LRU eviction.

Pure bookkeeping over block ids; the tensors live in :mod:`.kv_cache`. A block is in
exactly one of three states:

- free: on the free list, holds nothing;
- in use: reference count > 0 (owned by sequences or reservations);
- cached: reference count 0 but its content is known by hash; it can be reused by a
  prefix hit or evicted (least recently used first) when the free list runs dry.

``free_blocks`` counts free plus cached blocks, so it is exactly how many blocks an
allocation can get right now.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from splitserve_worker.engine.errors import NoCapacity
from splitserve_worker.engine.prefix_cache import EventKind, KVCacheEvent


class BlockPool:
    def __init__(self, num_blocks: int, *, max_events: int = 100_000) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._events: deque[KVCacheEvent] = deque(maxlen=max_events)

    # ---- counts ----
    @property
    def free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._by_hash)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    # ---- allocation ----
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (reference count 1 each), evicting cached ones if needed."""
        if n > self.free_blocks:
            raise NoCapacity(
                f"need {n} KV blocks, {self.free_blocks} free of {self.total_blocks}",
                needed=n,
                free=self.free_blocks,
            )
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                h = self._hash_of[b]
                if h is not None:
                    del self._by_hash[h]
                    self._hash_of[b] = None
                    evicted.append(h)
            self._ref[b] = 1
            out.append(b)
        if evicted:
            self._events.append(KVCacheEvent(EventKind.EVICTED, tuple(evicted)))
        # ascending: neighbouring ids are neighbouring memory, so a sequence's KV forms
        # long runs that a transfer moves in few large pieces (sequences free their blocks
        # tail first, which would otherwise hand them out again in descending order)
        out.sort()
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; the last reference frees or caches it.

        Pass a sequence's blocks in reverse order so that its tail is evicted before its
        head (heads are shared by more prompts).
        """
        for b in blocks:
            r = self._ref[b]
            if r <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self._ref[b] = r - 1
            if r == 1:
                if self._hash_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---- prefix cache ----
    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes`` (no reference taken)."""
        out: list[int] = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one reference on each of these cached blocks (a prefix hit)."""
        for b in blocks:
            if self._ref[b] == 0:
                self._evictable.pop(b, None)
            self._ref[b] += 1

    def register(self, block: int, block_hash: int) -> bool:
        """Record that ``block`` (in use) holds the content named by ``block_hash``.

        Returns False when another block already holds that content (this one stays
        uncached and is freed normally).
        """
        if self._hash_of[block] is not None or block_hash in self._by_hash:
            return False
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block
        self._events.append(KVCacheEvent(EventKind.STORED, (block_hash,)))
        return True

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def drain_events(self) -> list[KVCacheEvent]:
        out = list(self._events)
        self._events.clear()
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "block on the free list twice"
        evict = set(self._evictable)
        assert not free & evict, "block both free and cached"
        for b in range(self.total_blocks):
            if b in free:
                assert self._ref[b] == 0 and self._hash_of[b] is None, f"free block {b} in use"
            elif b in evict:
                assert self._ref[b] == 0 and self._hash_of[b] is not None, f"cached block {b}"
            else:
                assert self._ref[b] > 0, f"block {b} lost: not free, not cached, no owner"
        for h, b in self._by_hash.items():
            assert self._hash_of[b] == h, "hash map out of sync"
