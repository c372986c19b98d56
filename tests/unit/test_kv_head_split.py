"""A push into a decode pool split over tensor-parallel ranks, over real tcp ports into
each rank's own pool: every rank gets exactly its KV heads (replicated heads to each
of their ranks), a sender holding only some heads pushes only to the ranks that hold
them, each rank says in the worker's store when its part is whole, and a layout that
loses heads is refused before anything is sent."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from splitserve.kv_compat import Compat
from splitserve.tls import TlsConfig
from splitserve_worker.kv.head_split import check_cover, open_split, rank_parts
from splitserve_worker.kv.tcp_sender import TcpSenderBackend
from splitserve_worker.kv.transport import (
    BackendContext,
    RankTarget,
    TransferError,
    TransferTarget,
)
from splitserve_worker.parallel.layout import TPLayout
from splitserve_worker.server.rank_kv import (
    ExpectKV,
    ForgetKV,
    RankKVSpec,
    RankReceiver,
    placed_key,
    port_key,
)

TOKEN = "head-split-token"
LAYERS, BLOCK, HD, NBLOCKS = 2, 4, 8, 8


class Barrier:
    """The ranks' group as a rank's receiver uses it: only its barrier (one process)."""

    def __init__(self) -> None:
        self.met = 0

    def barrier(self) -> None:
        self.met += 1


@pytest.fixture
def store() -> Iterator[object]:
    s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30))
    yield s


def _compat(kv_heads: int) -> Compat:
    return Compat("m", "float32", BLOCK, LAYERS, kv_heads, HD, "test")


def _ranks(store: object, kv_heads: int, world: int) -> tuple[list[RankReceiver], TPLayout]:
    layout = TPLayout(world, 0, num_heads=4, num_kv_heads=kv_heads, intermediate_size=8)
    spec = RankKVSpec("127.0.0.1", 0, TOKEN, TlsConfig())
    rxs = []
    for r in range(world):
        n = len(layout.kv_heads(r))
        pool = torch.zeros(LAYERS, 2, NBLOCKS, BLOCK, n, HD)
        rxs.append(RankReceiver(pool, r, store.port, spec, _compat(kv_heads)))  # type: ignore[attr-defined]
    return rxs, layout


def _push(store: object, rxs: list[RankReceiver], layout: TPLayout, own: range, k: torch.Tensor,
          v: torch.Tensor, blocks: tuple[int, ...]) -> None:  # fmt: skip
    n = int(k.shape[1])  # [layers, tokens, heads, head_dim]
    group = Barrier()
    for rx in rxs:
        assert rx.handle(ExpectKV("r1", "lease1", blocks, n, LAYERS), group)  # type: ignore[arg-type]
    ranks = tuple(
        RankTarget(r, layout.kv_heads(r).start, layout.kv_heads(r).stop,
                   bytes(store.get(port_key(r))))  # type: ignore[attr-defined]
        for r in range(layout.world)
    )  # fmt: skip
    compat = _compat(layout.num_kv_heads)
    target = TransferTarget("r1", "lease1", "127.0.0.1:1", blocks, n, compat.hash,
                            kv_ranks=ranks)  # fmt: skip
    backend = TcpSenderBackend(BackendContext(compat=compat, token=TOKEN, streams=2))
    try:
        sender = open_split(backend, target, own, layout.num_kv_heads)
        for layer in range(LAYERS):
            lo = own.start
            sender.send_layer(layer, k[layer][:, own.start - lo : own.stop - lo],
                              v[layer][:, own.start - lo : own.stop - lo], 0)  # fmt: skip
        stats = sender.finish(30)
        assert stats.layers_sent == LAYERS
    finally:
        backend.close()


@pytest.mark.parametrize(("kv_heads", "world"), [(4, 2), (2, 4), (4, 1)])
def test_each_rank_gets_exactly_its_heads(store: object, kv_heads: int, world: int) -> None:
    rxs, layout = _ranks(store, kv_heads, world)
    try:
        n, blocks = 10, (5, 1, 6)
        k = torch.randn(LAYERS, n, kv_heads, HD)
        v = torch.randn(LAYERS, n, kv_heads, HD)
        _push(store, rxs, layout, range(kv_heads), k, v, blocks)
        for r, rx in enumerate(rxs):
            heads = layout.kv_heads(r)
            lease = rx.leases.find("lease1")
            assert lease.complete
            for layer in range(LAYERS):
                got_k, got_v = rx.receiver._pool.read(layer, list(blocks), 0, n)
                assert torch.equal(got_k, k[layer][:, heads.start : heads.stop])
                assert torch.equal(got_v, v[layer][:, heads.start : heads.stop])
            assert store.check([placed_key("lease1", r)])  # type: ignore[attr-defined]
            assert rx.handle(ForgetKV("r1", "lease1"), Barrier())  # type: ignore[arg-type]
            assert not store.check([placed_key("lease1", r)])  # type: ignore[attr-defined]
            assert len(rx.leases) == 0
    finally:
        for rx in rxs:
            rx.close()


def test_a_sender_with_some_heads_pushes_only_to_their_ranks(store: object) -> None:
    rxs, layout = _ranks(store, 4, 4)  # a head per rank
    try:
        n, blocks = 6, (2, 3)
        k = torch.randn(LAYERS, n, 2, HD)  # heads 2 and 3 only, as a prefill rank holds them
        v = torch.randn(LAYERS, n, 2, HD)
        _push(store, rxs, layout, range(2, 4), k, v, blocks)
        for r, rx in enumerate(rxs):
            lease = rx.leases.find("lease1")
            assert lease.complete == (r >= 2)
            assert lease.bytes_received == (2 * LAYERS * n * HD * 4 if r >= 2 else 0)
    finally:
        for rx in rxs:
            rx.close()


def test_which_heads_go_where_and_layouts_that_lose_heads() -> None:
    ranks = tuple(RankTarget(r, r // 2, r // 2 + 1, b"") for r in range(4))  # 2 heads, 4 ranks
    got = [(r.rank, h) for r, h in rank_parts(range(1, 2), ranks)]
    assert got == [(2, range(1, 2)), (3, range(1, 2))]  # a replicated head: to both its ranks
    check_cover(2, ranks)
    with pytest.raises(TransferError, match=r"hold KV heads \[0\] of 2"):
        check_cover(2, ranks[:2])
    with pytest.raises(TransferError, match="outside this model's 1"):
        check_cover(1, ranks)
