"""A push into a decode pool split over tensor-parallel ranks, over each rank's own real
tcp or gRPC port into its own pool: every rank gets exactly its KV heads (replicated
heads to each of their ranks), a sender holding only some heads pushes only to the ranks
that hold them, each rank says in the worker's store when its part is whole, a push over
the other backend than the one reserved is refused, a rank's ports served over mutual TLS
take no plain push, and a layout that loses heads is refused before anything is sent.

And the pushes of several prefill ranks side by side, each of its own heads, whatever
the two layouts (into one pool, and into ranks whose heads cut across theirs): each
acknowledges its own heads, the pool is whole only once every one has landed, and a span
naming heads the pool does not hold, or a stream that changes its heads, is refused."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import torch.distributed as dist
from splitserve.grpc_options import AUTH_HEADER
from splitserve.kv_compat import Compat
from splitserve.tls import TlsConfig
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.kv import kvwire
from splitserve_worker.kv.grpc_sender import CHANNEL_OPTIONS, push_address
from splitserve_worker.kv.head_split import check_cover, open_split, pool_part, rank_parts
from splitserve_worker.kv.nixl_common import loopback_env
from splitserve_worker.kv.transport import (
    SPAN_BACKENDS,
    BackendContext,
    RankTarget,
    TransferError,
    TransferTarget,
    create_sender_backend,
    unavailable_reason,
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
from tls_kit import SERVER_NAME, make_tls_files

TOKEN = "head-split-token"
NIXL_SKIP = unavailable_reason("nixl")
loopback_env()
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


def _ranks(
    store: object, kv_heads: int, world: int, tls: TlsConfig | None = None,
    backends: tuple[str, ...] = SPAN_BACKENDS,
) -> tuple[list[RankReceiver], TPLayout]:  # fmt: skip
    layout = TPLayout(world, 0, num_heads=12, num_kv_heads=kv_heads, intermediate_size=12)
    spec = RankKVSpec("127.0.0.1", 0, TOKEN, tls or TlsConfig(), world, backends)
    rxs = []
    for r in range(world):
        n = len(layout.kv_heads(r))
        pool = torch.zeros(LAYERS, 2, NBLOCKS, BLOCK, n, HD)
        rxs.append(RankReceiver(pool, r, store.port, spec, _compat(kv_heads)))  # type: ignore[attr-defined]
    return rxs, layout


def _push(store: object, rxs: list[RankReceiver], layout: TPLayout, own: range, k: torch.Tensor,
          v: torch.Tensor, blocks: tuple[int, ...], backend_name: str,
          reserved: str | None = None, tls: TlsConfig | None = None) -> None:  # fmt: skip
    """``reserved``: the backend the lease names (``backend_name`` unless said); ``tls``:
    the sender's."""
    n = int(k.shape[1])  # [layers, tokens, heads, head_dim]
    group = Barrier()
    for rx in rxs:
        step = ExpectKV("r1", "lease1", blocks, n, LAYERS, reserved or backend_name)
        assert rx.handle(step, group)  # type: ignore[arg-type]
    ranks = tuple(
        RankTarget(r, layout.kv_heads(r).start, layout.kv_heads(r).stop,
                   bytes(store.get(port_key(r, backend_name))))  # type: ignore[attr-defined]
        for r in range(layout.world)
    )  # fmt: skip
    compat = _compat(layout.num_kv_heads)
    target = TransferTarget("r1", "lease1", "127.0.0.1:1", blocks, n, compat.hash,
                            kv_ranks=ranks)  # fmt: skip
    ctx = BackendContext(compat=compat, token=TOKEN, streams=2, checksum_every=1, tls=tls)
    backend = create_sender_backend(backend_name, ctx)
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


@pytest.mark.parametrize("backend", ["tcp", "grpc"])
@pytest.mark.parametrize(("kv_heads", "world"), [(4, 2), (2, 4), (4, 1)])
def test_each_rank_gets_exactly_its_heads(
    store: object, kv_heads: int, world: int, backend: str
) -> None:
    rxs, layout = _ranks(store, kv_heads, world)
    try:
        n, blocks = 10, (5, 1, 6)
        k = torch.randn(LAYERS, n, kv_heads, HD)
        v = torch.randn(LAYERS, n, kv_heads, HD)
        _push(store, rxs, layout, range(kv_heads), k, v, blocks, backend)
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


@pytest.mark.parametrize("backend", ["tcp", "grpc"])
def test_a_sender_with_some_heads_pushes_only_to_their_ranks(store: object, backend: str) -> None:
    rxs, layout = _ranks(store, 4, 4)  # a head per rank
    try:
        n, blocks = 6, (2, 3)
        k = torch.randn(LAYERS, n, 2, HD)  # heads 2 and 3 only, as a prefill rank holds them
        v = torch.randn(LAYERS, n, 2, HD)
        _push(store, rxs, layout, range(2, 4), k, v, blocks, backend)
        for r, rx in enumerate(rxs):
            lease = rx.leases.find("lease1")
            assert lease.complete == (r >= 2)
            assert lease.bytes_received == (2 * LAYERS * n * HD * 4 if r >= 2 else 0)
    finally:
        for rx in rxs:
            rx.close()


@pytest.mark.parametrize(("backend", "reserved"), [("tcp", "grpc"), ("grpc", "tcp")])
def test_a_push_over_another_backend_than_reserved_is_refused(
    store: object, backend: str, reserved: str
) -> None:
    rxs, layout = _ranks(store, 2, 2)
    try:
        k, v = torch.randn(LAYERS, 4, 2, HD), torch.randn(LAYERS, 4, 2, HD)
        with pytest.raises(TransferError, match=f"reserved for '{reserved}', not {backend}"):
            _push(store, rxs, layout, range(2), k, v, (0,), backend, reserved)
        for rx in rxs:
            assert rx.leases.find("lease1").bytes_received == 0
    finally:
        for rx in rxs:
            rx.close()


@pytest.mark.parametrize("backend", ["tcp", "grpc"])
def test_each_rank_serves_its_ports_over_mutual_tls_only(
    store: object, tmp_path: Path, backend: str
) -> None:
    files = make_tls_files(tmp_path)
    tls = files.config(server_name=SERVER_NAME, mutual=True)
    rxs, layout = _ranks(store, 2, 2, tls)
    try:
        k, v = torch.randn(LAYERS, 4, 2, HD), torch.randn(LAYERS, 4, 2, HD)
        with pytest.raises(TransferError):  # a plain sender: refused, nothing written
            _push(store, rxs, layout, range(2), k, v, (0,), backend)
        assert [rx.leases.find("lease1").bytes_received for rx in rxs] == [0, 0]
        for rx in rxs:
            assert rx.handle(ForgetKV("r1", "lease1"), Barrier())  # type: ignore[arg-type]
        _push(store, rxs, layout, range(2), k, v, (0,), backend, tls=tls)
        assert all(rx.leases.find("lease1").complete for rx in rxs)
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


def _handle(store: object, layout: TPLayout, backend: str, n: int,
            blocks: tuple[int, ...]) -> TransferTarget:  # fmt: skip
    """The target a Reserve answer names: every rank's heads and port, or, for a worker
    of one pool, just its port."""
    ports = [bytes(store.get(port_key(r, backend))) for r in range(layout.world)]  # type: ignore[attr-defined]
    ranks = tuple(RankTarget(r, layout.kv_heads(r).start, layout.kv_heads(r).stop, ports[r])
                  for r in range(layout.world)) if layout.world > 1 else ()  # fmt: skip
    compat = _compat(layout.num_kv_heads)
    return TransferTarget("r1", "lease1", "127.0.0.1:1", blocks, n, compat.hash,
                          backend_metadata=ports[0], kv_ranks=ranks)  # fmt: skip


@pytest.mark.parametrize("backend", ["tcp", "grpc"])
@pytest.mark.parametrize(
    ("kv_heads", "prefill", "decode"),
    [(4, 2, 1), (4, 4, 1), (4, 4, 2), (6, 3, 2), (2, 2, 1)],
)
def test_every_prefill_rank_pushes_its_own_heads_into_pools_of_any_layout(
    store: object, kv_heads: int, prefill: int, decode: int, backend: str
) -> None:
    rxs, layout = _ranks(store, kv_heads, decode)
    source = TPLayout(prefill, 0, num_heads=kv_heads, num_kv_heads=kv_heads, intermediate_size=12)
    n, blocks = 9, (3, 0, 7)
    k = torch.randn(LAYERS, n, kv_heads, HD)
    v = torch.randn(LAYERS, n, kv_heads, HD)
    target = _handle(store, layout, backend, n, blocks)
    for rx in rxs:
        step = ExpectKV("r1", "lease1", blocks, n, LAYERS, backend)
        assert rx.handle(step, Barrier())  # type: ignore[arg-type]
    ctx = BackendContext(compat=_compat(kv_heads), token=TOKEN, streams=2, checksum_every=1)
    backend_ = create_sender_backend(backend, ctx)
    try:
        owns = [source.kv_heads(r) for r in source.kv_owners()]
        senders = [open_split(backend_, target, own, kv_heads) for own in owns]
        leases = [rx.leases.find("lease1") for rx in rxs]

        def push(parts: list[tuple[range, Any]]) -> None:
            for layer in range(LAYERS):  # side by side, as the ranks' forwards run
                for own, sender in parts:
                    sender.send_layer(layer, k[layer][:, own.start : own.stop],
                                      v[layer][:, own.start : own.stop], 0)  # fmt: skip
            for _, sender in parts:
                assert sender.finish(30).layers_sent == LAYERS  # its own heads acknowledged

        parts = list(zip(owns, senders, strict=True))
        push(parts[:-1])
        assert not all(lease.complete for lease in leases)  # the last rank's heads are missing
        push(parts[-1:])
        for r, (rx, lease) in enumerate(zip(rxs, leases, strict=True)):
            heads = layout.kv_heads(r)
            assert lease.complete
            assert lease.bytes_received == 2 * LAYERS * n * len(heads) * HD * 4
            for layer in range(LAYERS):
                got_k, got_v = rx.pool.read(layer, list(blocks), 0, n)
                assert torch.equal(got_k, k[layer][:, heads.start : heads.stop])
                assert torch.equal(got_v, v[layer][:, heads.start : heads.stop])
    finally:
        backend_.close()
        for rx in rxs:
            rx.close()


def test_a_part_names_its_place_in_the_pool_only_when_it_is_not_all_of_it() -> None:
    rank = RankTarget(1, 3, 6, b"")
    assert pool_part(range(3, 6), rank) is None
    assert pool_part(range(3, 4), rank) == range(0, 1)
    assert pool_part(range(4, 6), rank) == range(1, 3)


@pytest.mark.parametrize("backend", ["tcp", "grpc"])
def test_a_push_of_heads_the_pool_does_not_hold_is_refused_before_a_byte_lands(
    store: object, backend: str
) -> None:
    rxs, layout = _ranks(store, 4, 1)
    (rx,) = rxs
    try:
        n, blocks = 4, (1,)
        assert rx.handle(ExpectKV("r1", "lease1", blocks, n, LAYERS, backend), Barrier())  # type: ignore[arg-type]
        target = replace(_handle(store, layout, backend, n, blocks), pool_heads=range(3, 5))
        ctx = BackendContext(compat=_compat(4), token=TOKEN, streams=1)
        sender_backend = create_sender_backend(backend, ctx)
        try:
            sender = sender_backend.open(target)
            sender.send_layer(0, torch.ones(n, 2, HD), torch.ones(n, 2, HD), 0)
            with pytest.raises(TransferError, match=r"heads 3\.\.5 of a pool of 4"):
                sender.finish(30)
        finally:
            sender_backend.close()
        assert rx.leases.find("lease1").bytes_received == 0
        assert not rx.pool.pool.any()
    finally:
        rx.close()


def test_one_push_kv_stream_carries_one_set_of_heads(store: object) -> None:
    rxs, layout = _ranks(store, 4, 1)
    (rx,) = rxs
    try:
        n, blocks = 4, (1,)
        assert rx.handle(ExpectKV("r1", "lease1", blocks, n, LAYERS, "grpc"), Barrier())  # type: ignore[arg-type]
        target = _handle(store, layout, "grpc", n, blocks)
        data = torch.ones(2, n, 2, HD).numpy().tobytes()

        def span(layer: int, first: int) -> kvwire.KVSpan:
            return kvwire.KVSpan("r1", "lease1", layer, 0, n, memoryview(data),
                                 compat_hash=target.compat_hash, kv_head_start=first,
                                 kv_head_count=2)  # fmt: skip

        with grpc.insecure_channel(push_address(target), CHANNEL_OPTIONS) as ch:
            call = ch.stream_unary("/splitserve.v1.Worker/PushKV",
                                   request_serializer=kvwire.encode,
                                   response_deserializer=pb.PushKVAck.FromString)  # fmt: skip
            meta = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
            ack = call(iter([span(0, 0), span(1, 0)]), metadata=meta, timeout=30)
            assert ack.layers_received == LAYERS  # heads 0..2 of both layers: whole
            assert not rx.leases.find("lease1").complete  # heads 2..4 have not come
            with pytest.raises(grpc.RpcError) as err:
                call(iter([span(0, 2), span(1, 0)]), metadata=meta, timeout=30)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "one set of KV heads" in (err.value.details() or "")
    finally:
        rx.close()


@pytest.mark.nixl
@pytest.mark.skipif(NIXL_SKIP is not None, reason=NIXL_SKIP or "")
@pytest.mark.parametrize(("kv_heads", "prefill", "decode"), [(4, 1, 2), (4, 2, 2), (4, 1, 4)])
def test_nixl_writes_each_rank_its_heads_into_the_pool_its_own_agent_registered(
    store: object, kv_heads: int, prefill: int, decode: int
) -> None:
    """Each decode rank registers its own pool with an agent of its own and names it in
    the store; a sender holding whole ranks' heads writes each rank its blocks, and each
    rank says it is placed once every layer's notification came."""
    rxs, layout = _ranks(store, kv_heads, decode, backends=(*SPAN_BACKENDS, "nixl"))
    source = TPLayout(prefill, 0, num_heads=kv_heads, num_kv_heads=kv_heads, intermediate_size=12)
    n, blocks = 11, (6, 2, 3)
    k = torch.randn(LAYERS, n, kv_heads, HD)
    v = torch.randn(LAYERS, n, kv_heads, HD)
    target = _handle(store, layout, "nixl", n, blocks)
    for rx in rxs:
        assert rx.handle(ExpectKV("r1", "lease1", blocks, n, LAYERS, "nixl"), Barrier())  # type: ignore[arg-type]
    backend = create_sender_backend("nixl", BackendContext(compat=_compat(kv_heads), token=TOKEN))
    try:
        for own in (source.kv_heads(r) for r in source.kv_owners()):
            sender = open_split(backend, target, own, kv_heads)
            for layer in range(LAYERS):
                sender.send_layer(layer, k[layer][:, own.start : own.stop],
                                  v[layer][:, own.start : own.stop], 0)  # fmt: skip
            assert sender.finish(30).layers_sent == LAYERS
        for r, rx in enumerate(rxs):
            heads = layout.kv_heads(r)
            lease = rx.leases.find("lease1")
            assert _settle(lease)  # every layer's notification polled
            for layer in range(LAYERS):
                got_k, got_v = rx.pool.read(layer, list(blocks), 0, n)
                assert torch.equal(got_k, k[layer][:, heads.start : heads.stop])
                assert torch.equal(got_v, v[layer][:, heads.start : heads.stop])
            deadline = time.monotonic() + 10
            while not store.check([placed_key("lease1", r)]) and time.monotonic() < deadline:  # type: ignore[attr-defined]
                time.sleep(0.01)
            assert store.check([placed_key("lease1", r)])  # type: ignore[attr-defined]
        # NIXL writes whole blocks of a pool: never a part of its heads
        part = replace(target, kv_ranks=(), backend_metadata=target.kv_ranks[0].backend_metadata,
                       pool_heads=range(0, 1))  # fmt: skip
        with pytest.raises(TransferError, match="NIXL writes whole blocks of a pool"):
            backend.open(part)
    finally:
        backend.close()
        for rx in rxs:
            rx.close()


def _settle(lease: Any, within_s: float = 10.0) -> bool:
    """Whether ``lease`` completes within ``within_s`` (the notifications are polled)."""
    deadline = time.monotonic() + within_s
    while not lease.complete and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(lease.complete)
