"""One push of some KV heads, or into a decode worker whose KV pool is split over
tensor-parallel ranks.

A Reserve answer from such a worker names each rank's KV heads and where that rank
receives them (:class:`~.transport.RankTarget`); one from a worker of one pool holds
every head there. The sender (a prefill worker's rank, holding heads ``own``) opens one
push per decode rank that holds any of them, with the backend it would use for one
pool, and hands each exactly its part: the intersection of its own head range and the
rank's, a slice of the layer's ``[tokens, kv_heads, head_dim]`` (one copy of that slice,
which the push makes anyway for anything it keeps). A part that is not all of the
rank's heads names its place in the rank's pool (``TransferTarget.pool_heads``): the
decode rank then takes pushes of its heads from several prefill ranks side by side.
Ranks holding the same (replicated) head each get it: each pool needs its own copy.
The push is done when every rank acknowledged every layer of its part
(:meth:`HeadSplitSender.finish`); only then is the Commit sent, and the decode worker's
rank 0 checks once more that every rank has placed every head.

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


def pool_part(heads: range, rank: RankTarget) -> range | None:
    """Where ``heads`` (the model's) lie in ``rank``'s pool; None when they are all of it."""
    if heads == range(rank.kv_head_start, rank.kv_head_stop):
        return None
    return range(heads.start - rank.kv_head_start, heads.stop - rank.kv_head_start)


def open_split(
    backend: SenderBackend, target: TransferTarget, own: range, num_kv_heads: int
) -> KVSender:
    """The push of heads ``own`` (of ``num_kv_heads``) into ``target``: one push to each
    rank when the decode pool is split (``target.kv_ranks``) or this sender holds only
    some of the heads, else the backend's own."""
    ranks = target.kv_ranks
    if not ranks:
        if own == range(num_kv_heads):
            return backend.open(target)
        ranks = (RankTarget(rank=0, kv_head_start=0, kv_head_stop=num_kv_heads,
                            backend_metadata=target.backend_metadata),)  # fmt: skip
    check_cover(num_kv_heads, ranks)
    parts: list[tuple[range, KVSender]] = []
    try:
        for rank, heads in rank_parts(own, ranks):
            sub = dataclasses.replace(target, backend_metadata=rank.backend_metadata, kv_ranks=(),
                                      pool_heads=pool_part(heads, rank))  # fmt: skip
            parts.append((heads, backend.open(sub)))
    except BaseException:
        for _, sender in parts:
            sender.abort("the push to another rank could not open")
        raise
    return HeadSplitSender(own, parts)
