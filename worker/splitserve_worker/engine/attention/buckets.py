"""Batch-size buckets: a batch of ``n`` rows runs padded to the smallest bucket that holds
it, so a compiled kernel (or a captured CUDA graph) exists for a handful of sizes rather
than for every size continuous batching produces."""

from __future__ import annotations

from collections.abc import Sequence


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to ``max_batch``, and ``max_batch`` itself: at most twice the rows
    of the real batch, and log2(max) + 1 shapes (each costs a compile: seconds on the
    CPU, so fewer, coarser buckets win over tighter padding)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = []
    b = 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``n`` rows; ``None`` when none does."""
    for b in buckets:
        if b >= n:
            return b
    return None
