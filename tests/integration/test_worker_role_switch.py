"""A switchable worker changes its role in place: drain, refusals, migration, Health,
metrics and the free-block count, on in-process workers over real gRPC.

The drain is measured on a clock the test moves (:class:`FakeClock`), so "the drain
time ran out" is a step of the test, not a wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from clock_kit import FakeClock
from splitserve.roles import SWITCHING_METADATA
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.server.app import RunningWorker, start_worker
from splitserve_worker.server.config import WorkerConfig
from worker_kit import all_free, collect, prompt_of, split_request

pytestmark = pytest.mark.integration

TOKEN = "switch-token-7"
LONG = pb.SamplingParams(max_tokens=400, ignore_eos=True)
SHORT = pb.SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@asynccontextmanager
async def workers(
    model: Path, *roles: str, clock: FakeClock, switchable: bool = True
) -> AsyncIterator[list[RunningWorker]]:
    from splitserve_worker.models import load_model

    started: list[RunningWorker] = []
    try:
        for role in roles:
            cfg = WorkerConfig(role=role, model=str(model), token=TOKEN, num_blocks=400,  # type: ignore[arg-type]
                               threads=1, switchable=switchable, metrics_port=0,
                               drain_seconds=60.0)  # fmt: skip
            started.append(await start_worker(cfg, loaded=load_model(str(model)), clock=clock))
        yield started
    finally:
        for w in started:
            await w.stop(grace=0.2)


async def until(check: Any, what: str, tries: int = 2000) -> None:
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def switching_value(e: grpc.aio.AioRpcError) -> str | None:
    return dict(e.trailing_metadata() or ()).get(SWITCHING_METADATA)  # type: ignore[arg-type]


async def test_a_decode_worker_drains_its_streams_then_serves_prefill(
    tiny_model_path: Path,
) -> None:
    clock = FakeClock()
    async with workers(tiny_model_path, "prefill", "decode", clock=clock) as (p, d):
        pc, dc = WorkerClient(p.address, TOKEN), WorkerClient(d.address, TOKEN)
        base = {"p": (await pc.health()).free_blocks, "d": (await dc.health()).free_blocks}
        want, _ = await split_request(pc, dc, "before", prompt_of(40), SHORT)

        stream = dc.generate("long", prompt_of(30), LONG).__aiter__()
        first = await stream.__anext__()  # the stream runs on the decode worker
        switch = asyncio.create_task(dc.switch_role(pb.ROLE_PREFILL, timeout=120))

        async def switching() -> bool:
            return (await dc.health()).switching

        await until(switching, "Health says the switch is under way")
        h = await dc.health()
        assert (h.role, h.switching_to, h.switchable) == (pb.ROLE_DECODE, pb.ROLE_PREFILL, True)
        # new work of the old role is refused, saying why, while the old stream runs on
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await dc.reserve("new", 40, (await pc.health()).compat)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert switching_value(refused.value) == "prefill"
        with pytest.raises(grpc.aio.AioRpcError) as refused_local:
            await collect(dc.generate("new-local", prompt_of(20), SHORT))
        assert switching_value(refused_local.value) == "prefill"
        metrics = httpx.get(f"http://127.0.0.1:{d.metrics_port}/metrics").text
        assert "splitserve_role_switch_in_progress 1.0" in metrics

        rest = [t async for c in stream for t in c.token_ids]
        assert len(first.token_ids) + len(rest) == LONG.max_tokens  # finished, not cut
        done = await switch
        assert (done.previous, done.role, done.migrated) == (pb.ROLE_DECODE, pb.ROLE_PREFILL, 0)

        # the prefill worker becomes the decode one; the pair now runs the other way round
        done = await pc.switch_role(pb.ROLE_DECODE, timeout=120)
        assert done.role == pb.ROLE_DECODE
        got, _ = await split_request(dc, pc, "after", prompt_of(40), SHORT)
        assert got == want
        hp, hd = await all_free(pc), await all_free(dc)
        assert (hp.role, hp.switching, hp.switches) == (pb.ROLE_DECODE, False, 1)
        assert (hd.role, hd.switching, hd.switches) == (pb.ROLE_PREFILL, False, 1)
        assert (hp.free_blocks, hd.free_blocks) == (base["p"], base["d"])
        metrics = httpx.get(f"http://127.0.0.1:{d.metrics_port}/metrics").text
        assert 'splitserve_worker_role_active{role="prefill"} 1.0' in metrics
        assert 'splitserve_worker_role_active{role="decode"} 0.0' in metrics
        assert 'splitserve_role_switches_total{from_role="decode",to_role="prefill"} 1.0' in metrics
        assert "splitserve_role_switch_in_progress 0.0" in metrics
        # the engine's gauges carry the new role only
        assert 'splitserve_kv_blocks_free{role="prefill"}' in metrics
        assert 'splitserve_kv_blocks_free{role="decode"}' not in metrics
        with pytest.raises(grpc.aio.AioRpcError) as wrong:  # the old role is gone
            await dc.reserve("late", 40, hp.compat)
        assert wrong.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        await pc.close()
        await dc.close()


async def test_streams_left_when_the_drain_ends_are_ended_for_migration(
    tiny_model_path: Path,
) -> None:
    clock = FakeClock()
    async with workers(tiny_model_path, "decode", clock=clock) as (d,):
        dc = WorkerClient(d.address, TOKEN)
        base = (await dc.health()).free_blocks
        streams = [dc.generate(f"s{i}", prompt_of(20 + i), LONG).__aiter__() for i in range(3)]
        for s in streams:
            await s.__anext__()
        switch = asyncio.create_task(dc.switch_role(pb.ROLE_PREFILL, drain_seconds=5.0))

        async def switching() -> bool:
            return (await dc.health()).switching

        await until(switching, "the switch started")
        clock.advance(5.0)  # the drain time runs out with the streams still running
        for s in streams:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in s:
                    pass
            assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
            assert switching_value(ended.value) == "prefill"
        done = await switch
        assert (done.role, done.migrated) == (pb.ROLE_PREFILL, 3)
        h = await all_free(dc)
        assert (h.free_blocks, h.running, h.leases) == (base, 0, 0)
        await dc.close()


async def test_a_reservation_waiting_for_its_kv_is_released_by_the_switch(
    tiny_model_path: Path,
) -> None:
    clock = FakeClock()
    async with workers(tiny_model_path, "decode", clock=clock) as (d,):
        dc = WorkerClient(d.address, TOKEN)
        h0 = await dc.health()
        await dc.reserve("held", 40, h0.compat, lease_seconds=30.0)
        waiting = asyncio.ensure_future(
            collect(dc.generate("held", prompt_of(40), SHORT, expect_remote_kv=True))
        )
        switch = asyncio.create_task(dc.switch_role(pb.ROLE_PREFILL, drain_seconds=1.0))

        async def switching() -> bool:
            return (await dc.health()).switching

        await until(switching, "the switch started")
        clock.advance(1.0)
        done = await switch
        assert done.leases_released == 1
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await waiting
        assert switching_value(ended.value) == "prefill"
        h = await all_free(dc)
        assert (h.free_blocks, h.leases) == (h0.free_blocks, 0)
        await dc.close()


async def test_what_a_switch_refuses(tiny_model_path: Path) -> None:
    clock = FakeClock()
    async with workers(tiny_model_path, "decode", clock=clock, switchable=False) as (fixed,):
        c = WorkerClient(fixed.address, TOKEN)
        with pytest.raises(grpc.aio.AioRpcError) as fixed_role:
            await c.switch_role(pb.ROLE_PREFILL)
        assert fixed_role.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "--switchable" in (fixed_role.value.details() or "")
        assert not (await c.health()).switchable
        await c.close()
    async with workers(tiny_model_path, "decode", clock=clock) as (w,):
        c = WorkerClient(w.address, TOKEN)
        with pytest.raises(grpc.aio.AioRpcError) as no_role:
            await c.switch_role(pb.ROLE_UNSPECIFIED)
        assert no_role.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        same = await c.switch_role(pb.ROLE_DECODE)  # already so: nothing to do
        assert (same.role, same.previous) == (pb.ROLE_DECODE, pb.ROLE_DECODE)
        assert (await c.health()).switches == 0
        stream = c.generate("busy", prompt_of(20), LONG).__aiter__()
        await stream.__anext__()
        first = asyncio.create_task(c.switch_role(pb.ROLE_PREFILL, drain_seconds=5.0))

        async def switching() -> bool:
            return (await c.health()).switching

        await until(switching, "the first switch started")
        with pytest.raises(grpc.aio.AioRpcError) as second:
            await c.switch_role(pb.ROLE_BOTH)
        assert second.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        clock.advance(5.0)
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stream:
                pass
        assert (await first).role == pb.ROLE_PREFILL
        await c.close()
