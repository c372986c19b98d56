"""Which workers hold which KV blocks, from the workers' STORED/EVICTED events.

Blocks are named by the engine's chained block hash: the hash of block ``i``
covers every token up to the end of block ``i``, so a worker that holds the
first ``k`` hashes of a prompt can reuse its first ``k`` blocks. A lookup walks
the prompt's hashes in order and stops at the first block no candidate holds,
so its cost grows with the matched prefix, not with the size of the index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class EventKind(StrEnum):
    STORED = "stored"
    EVICTED = "evicted"
    CLEARED = "cleared"


@dataclass(frozen=True)
class BlockEvent:
    """One prefix-cache event of one worker."""

    kind: EventKind
    block_hashes: tuple[int, ...] = ()


class PrefixIndex:
    """A dict from block hash to the set of workers holding it, plus the reverse map."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}

    def __len__(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._holders)

    def blocks_of(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def stored(self, worker: str, hashes: Iterable[int]) -> None:
        mine = self._blocks.setdefault(worker, set())
        for h in hashes:
            if h in mine:
                continue
            mine.add(h)
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = {worker}
            else:
                holders.add(worker)

    def evicted(self, worker: str, hashes: Iterable[int]) -> None:
        mine = self._blocks.get(worker)
        if not mine:
            return
        for h in hashes:
            if h not in mine:
                continue
            mine.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def remove_worker(self, worker: str) -> None:
        """Forget everything a worker held (it left, restarted or cleared its cache)."""
        for h in self._blocks.pop(worker, set()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def apply(self, worker: str, event: BlockEvent) -> None:
        if event.kind is EventKind.STORED:
            self.stored(worker, event.block_hashes)
        elif event.kind is EventKind.EVICTED:
            self.evicted(worker, event.block_hashes)
        else:
            self.remove_worker(worker)

    def match(self, hashes: Sequence[int], among: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker holds; workers with none are absent.

        ``among`` restricts the answer to those workers (for example, healthy prefill
        workers).
        """
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        active = set(first) if among is None else first.intersection(among)
        out: dict[str, int] = {}
        for i in range(1, len(hashes)):
            if not active:
                return out
            holders = self._holders.get(hashes[i])
            if not holders:
                break
            if active <= holders:
                continue
            still = active & holders
            if len(still) != len(active):
                for w in active - still:
                    out[w] = i
            active = still
        else:
            i = len(hashes)
        for w in active:
            out[w] = i
        return out
