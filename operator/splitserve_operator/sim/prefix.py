"""A prefix cache of fixed-size KV blocks, least recently used out first.

Blocks are named by the trace's ``hash_ids``: block ``i``'s id stands for the
whole prefix up to and including block ``i``, so a prompt's reusable prefix is
the run of its leading ids found in the cache.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        self.capacity = max(0, capacity_blocks)
        self.block_tokens = block_tokens
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.lookups = 0
        self.hit_blocks = 0

    def __len__(self) -> int:
        return len(self._lru)

    def peek(self, hash_ids: tuple[int, ...] | None) -> int:
        """Leading blocks of ``hash_ids`` held, without touching the LRU order."""
        if not hash_ids:
            return 0
        n = 0
        lru = self._lru
        for h in hash_ids:
            if h not in lru:
                break
            n += 1
        return n

    def hit_tokens(self, hash_ids: tuple[int, ...] | None, prompt: int) -> int:
        """Prompt tokens that need no compute: the held prefix, at most ``prompt - 1``
        (the last prompt token always runs, to give the first output token)."""
        return min(self.peek(hash_ids) * self.block_tokens, prompt - 1)

    def use(self, hash_ids: tuple[int, ...] | None, prompt: int) -> int:
        """Look up and then hold every block of this prompt; returns the hit tokens."""
        if not hash_ids or self.capacity == 0:
            return 0
        hit = self.hit_tokens(hash_ids, prompt)
        self.lookups += 1
        self.hit_blocks += hit // self.block_tokens
        lru = self._lru
        for h in hash_ids:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)
        return hit
