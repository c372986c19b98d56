"""The events that announce blocks entering and leaving the prefix cache.

Blocks are named by the contract's chained hash (:mod:`splitserve.prefix_hash`), which
the router computes alike to find the worker that already holds a prompt's prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class EventKind(StrEnum):
    STORED = "stored"
    EVICTED = "evicted"


@dataclass(frozen=True)
class KVCacheEvent:
    """Blocks entered (STORED) or left (EVICTED) this engine's prefix cache."""

    kind: EventKind
    block_hashes: tuple[int, ...] = field(default_factory=tuple)
