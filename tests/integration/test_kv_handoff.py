"""The KV handoff between in-process workers on 127.0.0.1: leases, compat, auth, faults.

Each test starts real gRPC servers (prefill, decode, both) over engines running the tiny
model, and drives them with the router's :class:`WorkerClient`. Token parity between
worker *processes* is in ``test_kv_processes.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from clock_kit import FakeClock
from kv_kit import until
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.kv import tcp_wire
from splitserve_worker.kv.faults import FaultConfig
from splitserve_worker.kv.nixl_common import loopback_env
from splitserve_worker.kv.transport import unavailable_reason
from splitserve_worker.server.app import RunningWorker, start_worker
from splitserve_worker.server.config import WorkerConfig
from worker_kit import all_free

pytestmark = pytest.mark.integration

TOKEN = "test-token-1"
NIXL_SKIP = unavailable_reason("nixl")
loopback_env()


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@asynccontextmanager
async def workers(
    model: Path, *roles: str, clock: Any = None, **overrides: Any
) -> AsyncIterator[list[RunningWorker]]:
    from splitserve_worker.models import load_model

    started: list[RunningWorker] = []
    extra = {"clock": clock} if clock is not None else {}
    try:
        for role in roles:
            kw: dict[str, Any] = {"num_blocks": 400, "threads": 1, **overrides}
            cfg = WorkerConfig(role=role, model=str(model), token=TOKEN, **kw)  # type: ignore[arg-type]
            started.append(await start_worker(cfg, loaded=load_model(str(model)), **extra))
        yield started
    finally:
        for w in started:
            await w.stop(grace=0.2)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 31 + salt * 7) % 250 for i in range(n)]


SP = pb.SamplingParams(max_tokens=8, ignore_eos=True)


async def collect(stream: AsyncIterator[pb.TokenChunk]) -> tuple[list[int], str]:
    tokens: list[int] = []
    reason = ""
    async for c in stream:
        tokens += list(c.token_ids)
        reason = c.finish_reason or reason
    return tokens, reason


async def disaggregated(p: WorkerClient, d: WorkerClient, rid: str, prompt: list[int],
                        backend: str = "tcp") -> tuple[list[int], pb.PrefillResponse]:  # fmt: skip
    handle = await d.reserve(rid, len(prompt), (await p.health()).compat, kv_backend=backend)
    gen = asyncio.ensure_future(collect(d.generate(rid, prompt, SP, expect_remote_kv=True)))
    resp = await p.prefill(rid, prompt, SP, handle)
    tokens, reason = await gen
    assert reason == "length"
    return tokens, resp


def clients(ws: list[RunningWorker]) -> list[WorkerClient]:
    return [WorkerClient(w.address, TOKEN) for w in ws]


@pytest.mark.parametrize(
    "backend",
    ["tcp", "grpc", pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(
        NIXL_SKIP is not None, reason=NIXL_SKIP or "")])],
)  # fmt: skip
def test_disaggregated_tokens_match_colocated_in_process(
    tiny_model_path: Path, backend: str
) -> None:
    async def scenario() -> None:
        async with workers(tiny_model_path, "prefill", "decode", "both",
                           kv_backend=backend, checksums=True) as ws:  # fmt: skip
            p, d, b = clients(ws)
            for n in (1, 16, 17, 700):
                prompt = prompt_of(n, n)
                ref, _ = await collect(b.generate(f"b{n}", prompt, SP))
                got, resp = await disaggregated(p, d, f"r{n}", prompt, backend)
                assert got == ref, n
                assert resp.first_token == ref[0]
                assert resp.bytes_sent == 4 * 2 * n * 2 * 16 * 4
            # a colocated worker also takes remote KV
            prompt = prompt_of(300, 1)
            ref, _ = await collect(b.generate("b-ref", prompt, SP))
            got, _ = await disaggregated(p, b, "into-both", prompt, backend)
            assert got == ref
            for c in (p, d, b):
                h = await all_free(c)
                assert h.free_blocks == h.total_blocks and h.leases == 0

    asyncio.run(scenario())


def test_expired_lease_frees_every_reserved_block(tiny_model_path: Path) -> None:
    # the worker's leases run on a clock the test moves: a Generate waiting on a lease
    # that runs out ends DEADLINE_EXCEEDED, and the reaper frees every block
    clock = FakeClock()

    async def scenario() -> None:
        async with workers(tiny_model_path, "decode", clock=clock) as ws:
            (d,) = clients(ws)
            total = (await d.health()).total_blocks
            await d.reserve("a", 100, (await d.health()).compat, lease_seconds=10)
            await d.reserve("b", 1000, (await d.health()).compat, lease_seconds=10)
            h = await d.health()
            assert h.free_blocks == total - 7 - 63 and h.leases == 2
            gen = asyncio.ensure_future(collect(d.generate("a", prompt_of(100), SP,
                                                           expect_remote_kv=True)))  # fmt: skip
            handoff = ws[0].service.handoff
            assert handoff is not None
            # the clock moves only once the Generate waits on the lease: one arriving
            # after the expiry finds no reservation (NOT_FOUND), another outcome
            await until(lambda: handoff.awaiting_commit("a") or gen.done(), timeout=60,
                        what="the Generate to wait for its Commit")  # fmt: skip
            assert not gen.done()
            clock.advance(9)
            assert await handoff.reap_once() == 0
            assert (await d.health()).leases == 2
            clock.advance(1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gen
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no Commit before the lease expired" in (e.value.details() or "")
            h = await all_free(d, 10.0)
            assert (h.free_blocks, h.leases) == (total, 0)

    asyncio.run(scenario())


def test_release_and_cancel_free_a_reservation(tiny_model_path: Path) -> None:
    async def scenario() -> None:
        async with workers(tiny_model_path, "decode") as ws:
            (d,) = clients(ws)
            total = (await d.health()).total_blocks
            await d.reserve("a", 40, (await d.health()).compat)
            await d.reserve("b", 40, (await d.health()).compat)
            r = await d.release("a", "test")
            assert r.released and r.blocks_freed == 3
            assert await d.cancel("b")
            assert not await d.cancel("b")
            h = await d.health()
            assert (h.free_blocks, h.leases) == (total, 0)

    asyncio.run(scenario())


def test_compat_mismatch_is_refused_naming_the_difference(tiny_model_path: Path) -> None:
    async def scenario() -> None:
        async with workers(tiny_model_path, "prefill", "decode") as ws:
            p, d = clients(ws)
            mine = (await d.health()).compat
            other = pb.CompatInfo()
            other.CopyFrom(mine)
            other.block_size, other.dtype, other.hash = 32, "bfloat16", "0" * 64
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.reserve("x", 10, compat=other)
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "block_size: this worker=16, the caller=32" in (e.value.details() or "")
            assert "dtype: this worker='float32', the caller='bfloat16'" in (
                e.value.details() or ""
            )
            assert (await d.health()).free_blocks == (await d.health()).total_blocks

            # a handle from an incompatible decode worker: the prefill worker refuses it
            handle = await d.reserve("y", 10, compat=mine)
            handle.compat.head_dim, handle.compat.hash = 64, "1" * 64
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.prefill("y", prompt_of(10), SP, handle)
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "head_dim: this worker=16" in (e.value.details() or "")

            # and the stream itself is checked again
            handle = await d.reserve("z", 10, mine)

            async def bad() -> AsyncIterator[pb.KVLayer]:
                yield pb.KVLayer(request_id="z", lease_id=handle.lease_id, layer=0,
                                 num_tokens=0, compat_hash="deadbeef")  # fmt: skip

            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.push_kv(bad())
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "compat hash deadbeef differs" in (e.value.details() or "")
            h = await all_free(d)
            assert h.free_blocks == h.total_blocks

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("setting", "field", "words"),
    [
        ({"dtype": "bfloat16"}, "dtype", "dtype: this worker='float32', the caller='bfloat16'"),
        ({"block_size": 32}, "block_size", "block_size: this worker=16, the caller=32"),
    ],
)
def test_workers_that_differ_are_refused_from_their_own_hashes(
    tiny_model_path: Path, setting: dict[str, Any], field: str, words: str
) -> None:
    # two real workers, one started with another --dtype or --block-size: each reports
    # its own compat (no hash made up here), and the decode worker refuses to reserve for
    # the other's KV, naming the field; a real handle from it is refused by the other
    async def scenario() -> None:
        other = {"dtype": "float32", **setting}
        async with workers(tiny_model_path, "decode", dtype="float32") as (dw,), \
                workers(tiny_model_path, "prefill", **other) as (pw,):  # fmt: skip
            p, d = clients([pw, dw])
            theirs, mine = (await p.health()).compat, (await d.health()).compat
            assert theirs.hash != mine.hash and getattr(theirs, field) != getattr(mine, field)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.reserve("x", 10, compat=theirs)
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert words in (e.value.details() or ""), e.value.details()
            # a Reserve that states the decode worker's own compat: the prefill side checks
            # the handle's again
            handle = await d.reserve("y", 10, mine)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.prefill("y", prompt_of(10), SP, handle)
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert f"{field}: this worker=" in (e.value.details() or ""), e.value.details()
            h = await all_free(d)
            assert (h.free_blocks, h.leases) == (h.total_blocks, 0)

    asyncio.run(scenario())


def test_calls_without_the_token_are_refused(tiny_model_path: Path) -> None:
    async def scenario() -> None:
        async with workers(tiny_model_path, "both") as ws:
            for bad in ("", "wrong-token"):
                c = WorkerClient(ws[0].address, bad)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.health()
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.reserve("r", 10, pb.CompatInfo())
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(c.generate("g", prompt_of(5), SP))
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
                await c.close()
            (good,) = clients(ws)
            h = await good.health()
            assert h.role == pb.ROLE_BOTH and h.free_blocks == h.total_blocks

    asyncio.run(scenario())


@pytest.mark.parametrize("fault", ["fail", "corrupt"])
def test_injected_faults_fail_cleanly_and_leak_nothing(tiny_model_path: Path, fault: str) -> None:
    faults = FaultConfig(fail_prob=1.0) if fault == "fail" else FaultConfig(corrupt_prob=1.0)

    async def scenario() -> None:
        from splitserve_worker.models import load_model

        async with workers(tiny_model_path, "decode", checksums=True) as (dw,):
            cfg = WorkerConfig(
                role="prefill", model=str(tiny_model_path), token=TOKEN, num_blocks=400,
                threads=1, checksums=True, faults=faults,
            )  # fmt: skip
            pw = await start_worker(cfg, loaded=load_model(str(tiny_model_path)))
            try:
                p, d = clients([pw, dw])
                prompt = prompt_of(50)
                handle = await d.reserve("f", len(prompt), (await d.health()).compat)
                gen = asyncio.ensure_future(collect(d.generate("f", prompt, SP,
                                                               expect_remote_kv=True)))  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await p.prefill("f", prompt, SP, handle)
                want = "injected" if fault == "fail" else "checksum"
                assert want in (e.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError):
                    await gen
                for c in (p, d):
                    h = await all_free(c)
                    assert (h.free_blocks, h.leases) == (h.total_blocks, 0)
            finally:
                await pw.stop(grace=0.2)

    asyncio.run(scenario())


def test_roles_refuse_calls_they_do_not_serve(tiny_model_path: Path) -> None:
    async def scenario() -> None:
        async with workers(tiny_model_path, "prefill", "decode") as ws:
            p, d = clients(ws)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.reserve("r", 10, (await p.health()).compat)
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "role is 'prefill'" in (e.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.prefill("r", prompt_of(10), SP, pb.TransferHandle())
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(d.generate("nope", prompt_of(10), SP, expect_remote_kv=True))
            assert e.value.code() is grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.reserve("big", 10**6, (await d.health()).compat)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            tokens, reason = await collect(d.generate("local", prompt_of(10), SP))
            assert len(tokens) == 8 and reason == "length"

    asyncio.run(scenario())


def test_events_stream_prefix_cache_stores(tiny_model_path: Path) -> None:
    from splitserve.prefix_hash import block_hashes

    prompt = prompt_of(40)
    want = {h & 0xFFFFFFFFFFFFFFFF for h in block_hashes(prompt, 16)}
    assert len(want) == 2

    async def scenario() -> None:
        async with workers(tiny_model_path, "both") as ws:
            (b,) = clients(ws)
            stored: set[int] = set()

            async def listen() -> None:
                async for ev in b.events():
                    if ev.kind == pb.KVEvent.STORED:
                        stored.update(ev.block_hashes)
                    if want <= stored:
                        return

            task = asyncio.ensure_future(listen())
            # events carry no replay: the prompt runs once the stream is subscribed
            hub = ws[0].service.events
            await until(lambda: hub.subscribers == 1 or task.done(), timeout=60,
                        what="the Events stream to subscribe")  # fmt: skip
            await collect(b.generate("e", prompt, SP))
            await asyncio.wait_for(task, 10)
            assert want <= stored

    asyncio.run(scenario())


def test_transfer_metrics_are_served(tiny_model_path: Path) -> None:
    async def scenario() -> None:
        async with workers(tiny_model_path, "prefill", "decode", metrics_port=0) as ws:
            p, d = clients(ws)
            prompt = prompt_of(64)
            await disaggregated(p, d, "m", prompt)
            kv_bytes = 4 * 2 * 64 * 2 * 16 * 4
            texts = {}
            for w, direction in ((ws[0], "sent"), (ws[1], "received")):
                url = f"http://127.0.0.1:{w.metrics_port}/metrics"
                texts[direction] = await asyncio.to_thread(_get_text, url)
                want = (f'splitserve_kv_transfer_bytes_total{{backend="tcp",'
                        f'direction="{direction}"}} {float(kv_bytes)}')  # fmt: skip
                assert want in texts[direction], texts[direction][:2000]
            count = 'splitserve_kv_transfer_duration_seconds_count{backend="tcp"} 1.0'
            assert count in texts["sent"]

    asyncio.run(scenario())


def test_health_counts_prefills_in_progress(tiny_model_path: Path) -> None:
    """``prefilling`` covers a Prefill from its start to its end, push included: here the
    push goes to a peer that accepts the connection and never answers."""
    import socket

    async def scenario() -> None:
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            async with workers(tiny_model_path, "prefill", "decode", transfer_timeout_s=1.5) as ws:
                p, d = clients(ws)
                assert (await p.health()).prefilling == 0
                prompt = prompt_of(40)
                handle = await d.reserve("silent", len(prompt), (await d.health()).compat)
                port = silent.getsockname()[1]
                handle.decode_address = f"127.0.0.1:{port}"
                handle.backend_metadata = tcp_wire.handle_metadata(port, False)
                call = asyncio.ensure_future(p.prefill("silent", prompt, SP, handle))
                seen = 0
                deadline = time.monotonic() + 10
                while not call.done() and time.monotonic() < deadline:
                    seen = max(seen, (await p.health()).prefilling)
                    await asyncio.sleep(0.02)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() is grpc.StatusCode.UNAVAILABLE
                assert seen == 1
                assert (await p.health()).prefilling == 0
                assert (await d.health()).prefilling == 0  # a decode worker runs no Prefill
                await d.release("silent")

    asyncio.run(scenario())


def _get_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())
