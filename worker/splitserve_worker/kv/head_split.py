"""One push into a decode worker whose KV pool is split over tensor-parallel ranks.

A Reserve answer from such a worker names each rank's KV heads and where that rank
receives them (:class:`~.transport.RankTarget`). The sender opens one push per rank that
holds any of the heads it has, with the backend it would use for one pool, and hands
each exactly its heads: the intersection of its own head range and the rank's, a slice
of the layer's ``[tokens, kv_heads, head_dim]`` (one copy of that slice, which the push
makes anyway for anything it keeps). Ranks holding the same (replicated) head each get
it: each pool needs its own copy. The push is done when every rank acknowledged every
layer (:meth:`HeadSplitSender.finish`); only then is the Commit sent, and the decode
worker's rank 0 checks once more that every rank has placed its part.

Pure apart from the pushes it drives: no sockets of its own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from splitserve_worker.kv.transport import (
    KVSender,
    RankTarget,
    SenderBackend,
    SendStats,
    TransferError,
    TransferTarget,
)

if TYPE_CHECKING:
    import torch


def overlap(a: range, b: range) -> range:
    """The heads both ranges hold (empty when none)."""
    lo, hi = max(a.start, b.start), min(a.stop, b.stop)
    return range(lo, max(lo, hi))


def rank_parts(own: range, ranks: tuple[RankTarget, ...]) -> list[tuple[RankTarget, range]]:
    """Each decode rank that holds any of the heads ``own`` (this sender's), with those
    heads: what this sender pushes it."""
    out = []
    for r in ranks:
        heads = overlap(own, range(r.kv_head_start, r.kv_head_stop))
        if heads:
            out.append((r, heads))
    return out


def check_cover(num_kv_heads: int, ranks: tuple[RankTarget, ...]) -> None:
    """Every head of the model lands on some rank, and no rank names a head the model
    lacks: a layout this sender can bridge. Raises TransferError ``handle`` if not."""
    held: set[int] = set()
    for r in ranks:
        if not 0 <= r.kv_head_start < r.kv_head_stop <= num_kv_heads:
            raise TransferError(
                f"the handle's rank {r.rank} holds KV heads {r.kv_head_start}..{r.kv_head_stop}"
                f", outside this model's {num_kv_heads}: the workers serve different models",
                "handle",
            )
        held.update(range(r.kv_head_start, r.kv_head_stop))
    if len(held) != num_kv_heads:
        raise TransferError(
            f"the handle's ranks hold KV heads {sorted(held)} of {num_kv_heads}: a layout "
            "that loses heads; the decode worker is misconfigured",
            "handle",
        )


class HeadSplitSender:
    """A :class:`~.transport.KVSender` over one push per decode rank."""

    def __init__(self, own: range, parts: list[tuple[range, KVSender]]) -> None:
        self._own = own
        self._parts = parts

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_token: int) -> None:
        base = self._own.start
        for heads, sender in self._parts:
            lo, hi = heads.start - base, heads.stop - base
            if lo == 0 and hi == k.shape[1]:
                sender.send_layer(layer, k, v, start_token)
            else:
                sender.send_layer(layer, k[:, lo:hi], v[:, lo:hi], start_token)

    def finish(self, timeout: float) -> SendStats:
        stats = []
        try:
            for _, sender in self._parts:
                stats.append(sender.finish(timeout))
        except TransferError as e:
            self.abort(f"another rank's push failed: {e}")
            raise
        out = SendStats(layers_sent=min(s.layers_sent for s in stats))
        out.bytes_sent = sum(s.bytes_sent for s in stats)
        out.first_send = min(s.first_send for s in stats)
        out.done = max(s.done for s in stats)
        return out  # per-layer checksums cover one pool; each rank checked its spans

    def abort(self, reason: str) -> None:
        for _, sender in self._parts:
            sender.abort(reason)


def open_split(
    backend: SenderBackend, target: TransferTarget, own: range, num_kv_heads: int
) -> KVSender:
    """The push of heads ``own`` (of ``num_kv_heads``) into ``target``: one push to each
    rank when the decode pool is split (``target.kv_ranks``), else the backend's own."""
    if not target.kv_ranks:
        return backend.open(target)
    check_cover(num_kv_heads, target.kv_ranks)
    parts: list[tuple[range, KVSender]] = []
    try:
        for rank, heads in rank_parts(own, target.kv_ranks):
            sub = dataclasses.replace(target, backend_metadata=rank.backend_metadata, kv_ranks=())
            parts.append((heads, backend.open(sub)))
    except BaseException:
        for _, sender in parts:
            sender.abort("the push to another rank could not open")
        raise
    return HeadSplitSender(own, parts)
