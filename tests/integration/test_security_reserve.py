"""Reserve holds a decode worker's blocks for a caller, so every number it takes is
checked: a lease is finite and at most ``--max-lease-seconds`` (what a caller asks past
that is cut to it), and a Reserve names its request and the compat of its KV."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest
from clock_kit import FakeClock
from splitserve.grpc_options import auth_metadata
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.server.app import start_worker
from splitserve_worker.server.config import WorkerConfig
from worker_kit import all_free

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "reserve-test-token"
MAX_LEASE_S = 300.0
"""The workers' ``--max-lease-seconds`` unless set."""


def test_leases_are_finite_and_cut_to_the_workers_maximum(tiny_model_path: Path) -> None:
    """``lease_seconds`` of ``inf`` held blocks until the worker restarted, ``1e30`` as
    good as; now the one is refused and the other gets the worker's maximum, after which
    the reaper frees its blocks."""
    import torch
    from splitserve_worker.models import load_model

    torch.set_num_threads(1)
    clock = FakeClock()

    async def scenario() -> None:
        cfg = WorkerConfig(role="decode", model=str(tiny_model_path), token=TOKEN,
                           num_blocks=64, threads=1)  # fmt: skip
        w = await start_worker(cfg, loaded=load_model(str(tiny_model_path)), clock=clock)
        try:
            async with WorkerClient(w.address, TOKEN) as d:
                compat = (await d.health()).compat
                for bad in (math.inf, -math.inf, math.nan, -1.0):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await d.reserve(f"bad-{bad}", 10, compat, lease_seconds=bad)
                    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, bad
                    assert "lease_seconds must be a finite number" in str(e.value.details())
                assert (await d.health()).leases == 0
                await d.reserve("greedy", 10, compat, lease_seconds=1e30)
                await d.reserve("plain", 10, compat)  # the worker's own 30 s
                h = await d.health()
                assert h.leases == 2 and h.free_blocks < h.total_blocks
                handoff = w.service.handoff
                assert handoff is not None
                clock.advance(MAX_LEASE_S - 1)
                assert await handoff.reap_once() == 1  # the plain one; the greedy one holds
                clock.advance(2)
                assert await handoff.reap_once() == 1  # and no longer than the maximum
                h = await all_free(d)
                assert (h.free_blocks, h.leases) == (h.total_blocks, 0)
        finally:
            await w.stop(0.2)

    asyncio.run(scenario())


def test_a_reserve_without_its_request_id_or_compat_is_refused(tiny_model_path: Path) -> None:
    import torch
    from splitserve_worker.models import load_model

    torch.set_num_threads(1)

    async def scenario() -> None:
        cfg = WorkerConfig(role="decode", model=str(tiny_model_path), token=TOKEN,
                           num_blocks=64, threads=1)  # fmt: skip
        w = await start_worker(cfg, loaded=load_model(str(tiny_model_path)))
        try:
            async with grpc.aio.insecure_channel(w.address) as ch:
                reserve = ch.unary_unary("/splitserve.v1.Worker/Reserve",
                                         pb.ReserveRequest.SerializeToString,
                                         pb.ReserveResponse.FromString)  # fmt: skip
                health = ch.unary_unary("/splitserve.v1.Worker/Health",
                                        pb.HealthRequest.SerializeToString,
                                        pb.HealthResponse.FromString)  # fmt: skip
                md = auth_metadata(TOKEN)
                compat = (await health(pb.HealthRequest(), metadata=md, timeout=5)).compat
                cases = {
                    "no compat": pb.ReserveRequest(request_id="r", num_prompt_tokens=10),
                    "no request id": pb.ReserveRequest(num_prompt_tokens=10, compat=compat),
                }
                for what, req in cases.items():
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await reserve(req, metadata=md, timeout=5)
                    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, what
                    assert "Reserve needs" in str(e.value.details()), what
                h = await health(pb.HealthRequest(), metadata=md, timeout=5)
                assert (h.free_blocks, h.leases) == (h.total_blocks, 0)
        finally:
            await w.stop(0.2)

    asyncio.run(scenario())
