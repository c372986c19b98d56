"""The chained hash of a prompt's KV blocks, which the router and the engine must compute
alike: the engine names the blocks it caches by it (and announces them in KV events),
the router hashes a prompt the same way to find the worker that already holds its prefix.

A block's hash covers its own token ids and the hash of the block before it, so equal
hashes mean equal whole prefixes. Pure (standard library only).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

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
