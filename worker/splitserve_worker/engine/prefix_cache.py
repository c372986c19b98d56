"""Chained block hashes and the events that announce cached blocks.

A block's hash covers its own token ids and the hash of the block before it, so equal
hashes mean equal whole prefixes. The function is pure and public: the router computes
the same hashes for a prompt to find the worker that already holds its prefix.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

ROOT_HASH = 0
"""Parent hash of a sequence's first block."""


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """64-bit hash of one full block given its parent's hash."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, parent: int = ROOT_HASH, start: int = 0
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    ``start``/``parent`` continue an earlier call: hash blocks from token ``start`` on, the
    block before having hash ``parent``.
    """
    out: list[int] = []
    for i in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[i : i + block_size])
        out.append(parent)
    return out


class EventKind(StrEnum):
    STORED = "stored"
    EVICTED = "evicted"


@dataclass(frozen=True)
class KVCacheEvent:
    """Blocks entered (STORED) or left (EVICTED) this engine's prefix cache."""

    kind: EventKind
    block_hashes: tuple[int, ...] = field(default_factory=tuple)
