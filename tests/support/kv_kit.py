"""A decode side over a bare pool (no engine, no model) for the KV transport tests: the
lease table on a clock the test moves, the handoff, the worker's gRPC server (``grpc``
pushes) and the ``tcp`` KV port, as a decode worker wires them."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from clock_kit import FakeClock
from splitserve.grpc_options import SERVER_OPTIONS
from splitserve.kv_compat import Compat
from splitserve.metric_registry import Metrics
from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.lease import Lease, LeaseTable
from splitserve_worker.kv.tcp_server import Limits, TcpServer
from splitserve_worker.kv.transport import (
    BackendContext,
    ReceiverBackend,
    TransferTarget,
    create_receiver_backend,
)
from splitserve_worker.server.auth import TokenAuthInterceptor
from splitserve_worker.server.handoff import DecodeHandoff
from splitserve_worker.server.service import WorkerService, add_to_server
from splitserve_worker.server.tcp_sink import start_tcp_server

TOKEN = "kv-kit-token"


class NoEngine:
    """The engine's part in a drop: nothing to free on a bare pool; it notes who was."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def release(self, request_id: str) -> int:
        self.released.append(request_id)
        return 0


@dataclass
class BareDecode:
    compat: Compat
    pool: torch.Tensor
    leases: LeaseTable
    clock: FakeClock
    handoff: DecodeHandoff
    engine: NoEngine
    receivers: dict[str, ReceiverBackend]
    address: str
    """The gRPC server's ``host:port`` (what a Reserve handle's decode address is)."""
    tcp: TcpServer
    ttl: float = 30.0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def tcp_port(self) -> int:
        return self.tcp.port

    def reserve(self, rid: str, blocks: list[int], n: int, backend: str = "tcp",
                ttl: float | None = None) -> Lease:  # fmt: skip
        return self.leases.add(rid, blocks, num_tokens=n, num_layers=self.compat.num_layers,
                               ttl=ttl or self.ttl, backend=backend)  # fmt: skip

    def target(self, lease: Lease, lease_id: str | None = None) -> TransferTarget:
        """What a prefill worker makes of the Reserve handle for ``lease`` (its deadline
        on the wall clock, as handles carry it)."""
        import time

        remaining = lease.expires_at - self.clock()
        return TransferTarget(
            lease.request_id, lease_id or lease.lease_id, self.address, tuple(lease.block_ids),
            lease.num_tokens, self.compat.hash, self.receivers[lease.backend].backend_metadata(),
            time.time() + remaining,
        )  # fmt: skip

    def read(self, lease: Lease, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return PoolView(self.pool).read(layer, lease.block_ids, 0, lease.num_tokens)


@asynccontextmanager
async def bare_decode(
    compat: Compat,
    num_blocks: int,
    *,
    backends: tuple[str, ...] = ("tcp", "grpc"),
    tls: ssl.SSLContext | None = None,
    limits: Limits | None = None,
    token: str = TOKEN,
    **pacing: Any,
) -> AsyncIterator[BareDecode]:
    """A decode side with no engine; ``pacing``: the tcp port's ``clock`` and ``sleep``."""
    c = compat
    pool = torch.zeros(c.num_layers, 2, num_blocks, c.block_size, c.kv_heads, c.head_dim)
    clock = FakeClock()
    leases = LeaseTable(clock)
    ctx = BackendContext(compat=c, token=token, pool=PoolView(pool), leases=leases, clock=clock)
    # the tcp port is always there, as on a decode worker
    receivers = {name: create_receiver_backend(name, ctx) for name in {*backends, "tcp"}}
    engine = NoEngine()
    handoff = DecodeHandoff(engine, c, PoolView(pool), leases, receivers,
                            default_backend=backends[0], lease_seconds=30, address="",
                            metrics=Metrics())  # fmt: skip
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token)], options=SERVER_OPTIONS)
    add_to_server(WorkerService(role="decode", engine=None, compat=c, handoff=handoff,
                                prefill=None, events=None, kv_backends=list(backends)),  # type: ignore[arg-type]
                  server)  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tcp = start_tcp_server(handoff, "127.0.0.1", 0, token, tls, limits, **pacing)
    try:
        yield BareDecode(c, pool, leases, clock, handoff, engine, receivers,
                         f"127.0.0.1:{port}", tcp)  # fmt: skip
    finally:
        tcp.close()
        await server.stop(0)
        for r in receivers.values():
            r.close()


async def until(predicate: object, timeout: float = 10.0, what: str = "the condition") -> None:
    """Wait for ``predicate()`` to hold (polled on the event loop), at most ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
