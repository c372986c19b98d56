"""Both KV backends on a bare pool (no engine): spans, scattered blocks, checksums, expiry.

``grpc`` pushes go to the decode side's push port (``via="push-port"``: payloads received
in place) or, when a handle names none, to its gRPC server (``via="grpc-server"``: the
push client talking to grpcio's server)."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
import torch
from splitserve.grpc_options import SERVER_OPTIONS
from splitserve.metric_registry import Metrics
from splitserve_worker.kv import grpc_backend
from splitserve_worker.kv.compat import Compat
from splitserve_worker.kv.layout import PoolView, as_bytes, token_chunks
from splitserve_worker.kv.lease import LeaseTable
from splitserve_worker.kv.nixl_common import loopback_env
from splitserve_worker.kv.transport import (
    BackendContext,
    TransferError,
    TransferTarget,
    create_receiver_backend,
    create_sender_backend,
    unavailable_reason,
)
from splitserve_worker.server.auth import TokenAuthInterceptor
from splitserve_worker.server.handoff import DecodeHandoff
from splitserve_worker.server.push_sink import start_push_server
from splitserve_worker.server.service import WorkerService, add_to_server

pytestmark = pytest.mark.integration
loopback_env()

TOKEN = "transport-token"
NIXL_SKIP = unavailable_reason("nixl")
L, NB, BS, H, D = 3, 40, 16, 2, 8
COMPAT = Compat("bare", "float32", BS, L, H, D, "LKBTHD-v1")
NIXL_MARKS = [pytest.mark.nixl, pytest.mark.skipif(NIXL_SKIP is not None, reason=NIXL_SKIP or "")]
BACKENDS = ["grpc", pytest.param("nixl", marks=NIXL_MARKS)]
VIAS = ["push-port", "grpc-server"]


class NoEngine:
    """The engine's part in a drop: nothing to free on a bare pool."""

    async def release(self, request_id: str) -> int:
        return 0


HANDOFFS: dict[str, DecodeHandoff] = {}
"""The handoff behind each receiver address (for the tests that drop a lease)."""


@asynccontextmanager
async def receiver(
    backend: str, via: str = "push-port"
) -> AsyncIterator[tuple[str, Any, LeaseTable, torch.Tensor]]:
    pool = torch.zeros(L, 2, NB, BS, H, D)
    leases = LeaseTable()
    ctx = BackendContext(compat=COMPAT, token=TOKEN, pool=PoolView(pool), leases=leases)
    recv = create_receiver_backend(backend, ctx)
    handoff = DecodeHandoff(NoEngine(), COMPAT, PoolView(pool), leases, {backend: recv},
                            default_backend=backend, lease_seconds=30, address="",
                            metrics=Metrics())  # fmt: skip
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(TOKEN)], options=SERVER_OPTIONS)
    add_to_server(WorkerService(role="decode", engine=None, compat=COMPAT, handoff=handoff,
                                prefill=None, events=None, kv_backends=[backend]),  # type: ignore[arg-type]
                  server)  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    push = None
    if backend == "grpc" and via == "push-port":
        push = start_push_server(handoff, "127.0.0.1", 0, TOKEN)
    HANDOFFS[f"127.0.0.1:{port}"] = handoff
    try:
        yield f"127.0.0.1:{port}", recv, leases, pool
    finally:
        HANDOFFS.pop(f"127.0.0.1:{port}")
        if push is not None:
            push.close()
        await server.stop(0)
        recv.close()


def fresh_kv(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
            for _ in range(L)]  # fmt: skip


@pytest.mark.parametrize(("backend", "streams", "via"), [
    ("grpc", 1, "push-port"), ("grpc", 3, "push-port"), ("grpc", 1, "grpc-server"),
    ("grpc", 3, "grpc-server"), pytest.param("nixl", 1, "", marks=NIXL_MARKS)])  # fmt: skip
def test_spans_land_in_scattered_blocks_with_checksums(
    backend: str, streams: int, via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grpc deals the spans to ``streams`` connections: a layer's spans arrive out of order
    # tiny wire messages, so one span crosses several messages and several blocks
    monkeypatch.setattr(grpc_backend, "token_chunks", lambda n, b: token_chunks(n, b, 700))

    async def scenario() -> None:
        async with receiver(backend, via) as (address, recv, leases, pool):
            if backend == "grpc":
                assert (recv.backend_metadata() != b"") == (via == "push-port")
            n, blocks = 100, [33, 2, 17, 5, 39, 0, 21]
            lease = leases.add("r", blocks, num_tokens=n, num_layers=L, ttl=30, backend=backend)
            target = TransferTarget("r", lease.lease_id, address, tuple(blocks), n, COMPAT.hash,
                                    recv.backend_metadata(), time.time() + 30)  # fmt: skip
            sender_backend = create_sender_backend(
                backend, BackendContext(compat=COMPAT, token=TOKEN, checksums=True, streams=streams)
            )
            kv = fresh_kv(n, 1)
            sender = sender_backend.open(target)
            for start, end in ((0, 37), (37, 100)):  # two chunks, as a long prompt gives
                for layer in range(L):
                    k, v = kv[layer]
                    sender.send_layer(layer, k[start:end], v[start:end], start)
            stats = await asyncio.to_thread(sender.finish, 30)
            assert await asyncio.to_thread(recv.wait_layers, lease, 10)
            assert stats.layers_sent == L and stats.bytes_sent == L * 2 * n * H * D * 4
            view = PoolView(pool)
            for layer in range(L):
                got_k, got_v = view.read(layer, blocks, 0, n)
                assert torch.equal(got_k, kv[layer][0]) and torch.equal(got_v, kv[layer][1])
                assert stats.layer_crc32[2 * layer] == zlib.crc32(as_bytes(kv[layer][0]))
                assert stats.layer_crc32[2 * layer + 1] == zlib.crc32(as_bytes(kv[layer][1]))
            others = [b for b in range(NB) if b not in blocks]
            assert pool[:, :, others].abs().sum() == 0
            sender_backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("via", VIAS)
def test_a_push_writes_nothing_once_its_reservation_is_dropped(
    via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Released mid-push (or dropped by a failing sibling stream): the blocks may be
    # someone else's from then on, so the spans still arriving must not land in them.
    monkeypatch.setattr(grpc_backend, "token_chunks", lambda n, b: token_chunks(n, b, 700))

    async def scenario() -> None:
        async with receiver("grpc", via) as (address, recv, leases, pool):
            n, blocks = 100, [3, 4, 5, 6, 7, 8, 9]
            lease = leases.add("r", blocks, num_tokens=n, num_layers=L, ttl=30, backend="grpc")
            target = TransferTarget("r", lease.lease_id, address, tuple(blocks), n, COMPAT.hash,
                                    recv.backend_metadata(), time.time() + 30)  # fmt: skip
            sender_backend = create_sender_backend("grpc", BackendContext(COMPAT, TOKEN, streams=2))
            sender = sender_backend.open(target)
            kv = fresh_kv(n, 3)
            await asyncio.to_thread(sender.send_layer, 0, kv[0][0], kv[0][1], 0)
            while lease.bytes_received == 0:
                await asyncio.sleep(0.005)
            # a Release: once the drop returns, the blocks are the engine's to reuse, and no
            # span may land in them (on the server's loop, or off it on the push port)
            await HANDOFFS[address].drop("r", "released")
            assert not leases.contains("r")
            pool.zero_()
            for layer in range(1, L):
                k, v = kv[layer]
                await asyncio.to_thread(sender.send_layer, layer, k, v, 0)
            with pytest.raises(TransferError) as e:
                await asyncio.to_thread(sender.finish, 30)
            assert "dropped mid-push" in str(e.value) or "no reservation" in str(e.value)
            assert pool.abs().sum() == 0
            sender_backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("backend", "via"), [
    ("grpc", "push-port"), ("grpc", "grpc-server"),
    pytest.param("nixl", "", marks=NIXL_MARKS)])  # fmt: skip
def test_a_stale_lease_is_refused(backend: str, via: str) -> None:
    async def scenario() -> None:
        async with receiver(backend, via) as (address, recv, leases, pool):
            blocks = [1, 2]
            lease = leases.add("r", blocks, num_tokens=20, num_layers=L, ttl=30, backend=backend)
            deadline = time.time() - 1 if backend == "nixl" else time.time() + 30
            lease_id = lease.lease_id if backend == "nixl" else "not-the-lease"
            target = TransferTarget("r", lease_id, address, tuple(blocks), 20, COMPAT.hash,
                                    recv.backend_metadata(), deadline)  # fmt: skip
            ctx = BackendContext(compat=COMPAT, token=TOKEN)
            sender_backend = create_sender_backend(backend, ctx)
            sender = sender_backend.open(target)
            for layer, (k, v) in enumerate(fresh_kv(20, 2)):
                sender.send_layer(layer, k, v, 0)
            with pytest.raises(TransferError) as e:
                await asyncio.to_thread(sender.finish, 30)
            assert ("expired" if backend == "nixl" else "stale") in str(e.value)
            assert pool.abs().sum() == 0
            sender_backend.close()

    asyncio.run(scenario())


@pytest.mark.nixl
@pytest.mark.skipif(NIXL_SKIP is not None, reason=NIXL_SKIP or "")
@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_nixl_layers_spread_over_posting_lanes(lanes: int) -> None:
    from splitserve_worker.kv.nixl_backend import NixlSenderBackend

    async def scenario() -> None:
        async with receiver("nixl") as (address, recv, leases, pool):
            n, blocks = 40, [9, 3, 30]
            lease = leases.add("r", blocks, num_tokens=n, num_layers=L, ttl=30, backend="nixl")
            target = TransferTarget("r", lease.lease_id, address, tuple(blocks), n, COMPAT.hash,
                                    recv.backend_metadata(), time.time() + 30)  # fmt: skip
            sender_backend = NixlSenderBackend(BackendContext(compat=COMPAT, token=TOKEN), lanes)
            posted: list[tuple[int, int]] = []
            for i, lane in enumerate(sender_backend.lanes):

                def put(job: Any, i: int = i, put: Any = lane.jobs.put) -> None:
                    posted.append((i, job.layer))
                    put(job)

                lane.jobs.put = put  # type: ignore[method-assign]
            kv = fresh_kv(n, 3)
            sender = sender_backend.open(target)
            for layer in range(L):
                sender.send_layer(layer, *kv[layer], 0)
            await asyncio.to_thread(sender.finish, 30)
            assert await asyncio.to_thread(recv.wait_layers, lease, 10)
            assert sorted(posted) == sorted((layer % lanes, layer) for layer in range(L))
            view = PoolView(pool)
            for layer in range(L):
                got_k, got_v = view.read(layer, blocks, 0, n)
                assert torch.equal(got_k, kv[layer][0]) and torch.equal(got_v, kv[layer][1])
            sender_backend.close()

    asyncio.run(scenario())
