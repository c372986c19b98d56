"""Malformed gRPC messages to workers are refused clearly and harm nobody else.

A prefill and a decode worker run in-process on 127.0.0.1 with a good handoff in flight;
meanwhile the decode worker gets wrong shapes and sizes, unknown request and lease ids,
negative and huge token counts, out-of-range layers, out-of-vocabulary ids, garbage
bytes in ``KVLayer.data`` and in whole messages. Each call ends with a documented
status code (never UNKNOWN or INTERNAL from a handler) and a message; the good request
completes with the right tokens; every block is free afterwards.
"""

from __future__ import annotations

import asyncio
import os
import threading
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fuzz_profiles import scaled
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from splitserve.grpc_options import auth_metadata
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.server.app import RunningWorker, start_worker
from splitserve_worker.server.config import WorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "fuzz-grpc-token"
MD = auth_metadata(TOKEN)
SP = pb.SamplingParams(max_tokens=8, ignore_eos=True)
CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""What a refused malformed call may answer: each says what was wrong with the call."""


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 37 + salt * 11) % 250 for i in range(n)]


async def start(model: Path, role: str) -> RunningWorker:
    from splitserve_worker.models import load_model

    cfg = WorkerConfig(role=role, model=str(model), token=TOKEN, num_blocks=200, threads=1,  # type: ignore[arg-type]
                       checksums=True, lease_seconds=5.0)  # fmt: skip
    return await start_worker(cfg, loaded=load_model(str(model)))


async def refused(call: Awaitable[Any], what: str) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        assert e.code() in CLEAR, f"{what}: {e.code().name} {e.details()!r}"
        assert e.details(), f"{what}: refused without a message"
        return e.code()
    raise AssertionError(f"{what}: accepted")


async def good_handoff(p: WorkerClient, d: WorkerClient, rid: str, prompt: list[int]) -> list[int]:
    handle = await d.reserve(rid, len(prompt), (await p.health()).compat)
    tokens: list[int] = []

    async def collect() -> None:
        async for c in d.generate(rid, prompt, SP, expect_remote_kv=True):
            tokens.extend(c.token_ids)

    gen = asyncio.ensure_future(collect())
    await p.prefill(rid, prompt, SP, handle)
    await gen
    return tokens


async def local(d: WorkerClient, rid: str, prompt: list[int]) -> list[int]:
    out: list[int] = []
    async for c in d.generate(rid, prompt, SP):
        out.extend(c.token_ids)
    return out


def pushes(*layers: pb.KVLayer) -> Callable[[], AsyncIterator[pb.KVLayer]]:
    async def gen() -> AsyncIterator[pb.KVLayer]:
        for m in layers:
            yield m

    return gen


def test_malformed_calls_are_refused_while_a_good_request_completes(tiny_model_path: Path) -> None:
    async def scenario() -> None:
        pw, dw = await start(tiny_model_path, "prefill"), await start(tiny_model_path, "decode")
        try:
            async with WorkerClient(pw.address, TOKEN) as p, WorkerClient(dw.address, TOKEN) as d:
                await run(p, d)
        finally:
            await pw.stop(0.2)
            await dw.stop(0.2)

    async def run(p: WorkerClient, d: WorkerClient) -> None:
        prompt = prompt_of(70)
        want = await local(d, "ref", prompt)
        base_d, base_p = await d.health(), await p.health()
        compat = base_d.compat
        # a reservation the malformed pushes aim at
        h = await d.reserve("victim", 40, compat)
        token_bytes = 2 * compat.kv_heads * compat.head_dim * 4  # float32 K+V per token
        ok = dict(request_id="victim", lease_id=h.lease_id, compat_hash=compat.hash)
        good = asyncio.ensure_future(good_handoff(p, d, "good", prompt))

        bad_calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("reserve negative tokens", lambda: d.reserve("neg", -5, compat)),
            ("reserve zero tokens", lambda: d.reserve("zero", 0, compat)),
            ("reserve huge", lambda: d.reserve("huge", 2**31 - 1, compat)),
            ("reserve bad backend", lambda: d.reserve("bk", 10, compat,
                                                      kv_backend="carrier-pigeon")),
            ("reserve twice", lambda: d.reserve("victim", 10, compat)),
            ("reserve wrong compat", lambda: d.reserve("cx", 8, compat=pb.CompatInfo(
                hash="0" * 64, model="other", dtype="float16"))),
            ("push unknown request", lambda: d.push_kv(pushes(pb.KVLayer(
                request_id="nobody", lease_id="x", compat_hash=compat.hash, num_tokens=1,
                data=b"\0" * token_bytes))())),
            ("push wrong lease", lambda: d.push_kv(pushes(pb.KVLayer(
                **{**ok, "lease_id": "forged"}, num_tokens=1, data=b"\0" * token_bytes))())),
            ("push no compat", lambda: d.push_kv(pushes(pb.KVLayer(
                **{**ok, "compat_hash": ""}, num_tokens=1, data=b"\0" * token_bytes))())),
        ]  # fmt: skip
        for what, call in bad_calls:  # made one at a time: an aio call starts when made
            await refused(call(), what)
        garbage = os.urandom(token_bytes * 3 + 5)
        zero = b"\0" * token_bytes
        push_cases: list[tuple[str, dict[str, Any]]] = [
            ("garbage data size", dict(layer=0, num_tokens=3, data=garbage)),
            ("negative layer", dict(layer=-1, num_tokens=1, data=zero)),
            ("layer past the model", dict(layer=99, num_tokens=1, data=zero)),
            ("negative start", dict(start_token=-3, num_tokens=1, data=zero)),
            ("negative start, no tokens", dict(start_token=-1, num_tokens=0, data=b"")),
            ("start past the reservation", dict(start_token=40, num_tokens=1, data=zero)),
            ("span past the reservation", dict(start_token=39, num_tokens=2, data=zero * 2)),
            ("span past the blocks", dict(start_token=47, num_tokens=2, data=zero * 2)),
            ("negative tokens", dict(num_tokens=-1, data=b"")),
            ("huge tokens", dict(num_tokens=2**31 - 1, data=zero)),
            ("bad crc", dict(num_tokens=1, data=zero, crc32=12345)),
        ]
        for i, (what, fields) in enumerate(push_cases):
            # each case on a reservation of its own, which the refusal frees
            h = await d.reserve(f"victim-{i}", 40, compat)
            msg = pb.KVLayer(request_id=f"victim-{i}", lease_id=h.lease_id,
                             compat_hash=compat.hash, **fields)  # fmt: skip
            code = await refused(d.push_kv(pushes(msg)()), f"push {what}")
            assert code is not grpc.StatusCode.NOT_FOUND, f"push {what}: {code}"
            for _ in range(100):
                h_now = await d.health()
                if h_now.leases <= 1:  # only the good request's may remain
                    break
                await asyncio.sleep(0.02)
        gen_cases: list[tuple[str, pb.GenerateRequest]] = [
            ("out of vocab", pb.GenerateRequest(request_id="g1", prompt_token_ids=[5, 10**6],
                                                sampling=SP)),
            ("negative id", pb.GenerateRequest(request_id="g2", prompt_token_ids=[5, -2],
                                               sampling=SP)),
            ("empty prompt", pb.GenerateRequest(request_id="g3", sampling=SP)),
            ("negative max_tokens", pb.GenerateRequest(
                request_id="g4", prompt_token_ids=[5, 6],
                sampling=pb.SamplingParams(max_tokens=-1))),
            ("bad temperature", pb.GenerateRequest(
                request_id="g5", prompt_token_ids=[5, 6],
                sampling=pb.SamplingParams(max_tokens=2, temperature=-1.0))),
            ("prompt larger than the cache", pb.GenerateRequest(
                request_id="g6", prompt_token_ids=[5] * 200 * 16, sampling=SP)),
            ("remote KV never reserved", pb.GenerateRequest(
                request_id="g7", prompt_token_ids=[5, 6], sampling=SP, expect_remote_kv=True)),
        ]  # fmt: skip
        for what, req in gen_cases:

            async def drain(r: pb.GenerateRequest = req) -> None:
                stream = d.generate(r.request_id, r.prompt_token_ids, r.sampling,
                                    r.expect_remote_kv)  # fmt: skip
                async for _ in stream:
                    pass

            await refused(drain(), f"generate {what}")
        await refused(d.commit("nobody", "x", 0), "commit unknown")
        # a handle whose numbers do not add up, sent to the prefill worker
        hp = await d.reserve("ph", 10, compat)
        bad_prefills = [
            ("prefill count mismatch", pb.PrefillRequest(request_id="ph", handle=hp,
                                                         prompt_token_ids=[5] * 11, sampling=SP)),
            ("prefill handle for another request", pb.PrefillRequest(
                request_id="other", handle=hp, prompt_token_ids=[5] * 10, sampling=SP)),
            ("prefill wrong compat", pb.PrefillRequest(
                request_id="ph", prompt_token_ids=[5] * 10, sampling=SP,
                handle=pb.TransferHandle(request_id="ph", decode_address=d.address,
                                         num_prompt_tokens=10,
                                         compat=pb.CompatInfo(hash="f" * 64)))),
            ("prefill out of vocab", pb.PrefillRequest(
                request_id="ph", handle=hp, prompt_token_ids=[5] * 9 + [10**7], sampling=SP)),
        ]  # fmt: skip
        for what, preq in bad_prefills:
            await refused(p.prefill(preq.request_id, preq.prompt_token_ids, preq.sampling,
                                    preq.handle), what)  # fmt: skip
        await d.release("ph")
        # a handle pointing nowhere: the push cannot start, the prefill worker says so
        for nowhere in ("127.0.0.1:1", "no-such-host.invalid:7000"):
            preq = pb.PrefillRequest(
                request_id="nw", prompt_token_ids=[5] * 10, sampling=SP,
                handle=pb.TransferHandle(request_id="nw", decode_address=nowhere,
                                         num_prompt_tokens=10, compat=compat,
                                         lease_id="x", block_ids=[0]))  # fmt: skip
            try:
                await p.prefill(preq.request_id, preq.prompt_token_ids, preq.sampling,
                                preq.handle, timeout=60)  # fmt: skip
                raise AssertionError(f"a push to {nowhere} succeeded")
            except grpc.aio.AioRpcError as e:
                assert e.code() is grpc.StatusCode.UNAVAILABLE and e.details(), (nowhere, e)
        # reserved, never pushed: the stream ends when the lease does, with the code for it
        await d.reserve("never", 8, compat)

        async def never() -> None:
            async for _ in d.generate("never", [5] * 8, SP, expect_remote_kv=True, timeout=30):
                pass

        assert await refused(never(), "never pushed") is grpc.StatusCode.DEADLINE_EXCEEDED
        # whole messages of garbage bytes: not messages at all, so on a bare channel
        async with grpc.aio.insecure_channel(d.address) as channel:
            for method in ("Reserve", "Commit", "Generate", "Release", "Cancel"):
                raw = channel.unary_unary(
                    f"/splitserve.v1.Worker/{method}",
                    request_serializer=lambda b: b,
                    response_deserializer=lambda b: b,
                )
                try:
                    await raw(b"\xff\xfe\x00garbage" + os.urandom(32), metadata=MD, timeout=5)
                except grpc.aio.AioRpcError as e:
                    # grpcio answers an unparsable message itself (UNKNOWN), naming the cause
                    if e.code() not in CLEAR:
                        assert e.code() is grpc.StatusCode.UNKNOWN, (method, e)
                        assert "Error parsing message" in (e.details() or ""), (method, e)
                else:
                    raise AssertionError(f"{method}: garbage bytes were accepted")
        assert await good == want, "the good request decoded different tokens"
        await settle(d, base_d.free_blocks)
        await settle(p, base_p.free_blocks)

    asyncio.run(scenario())


async def settle(c: WorkerClient, free: int, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        h = await c.health()
        if (h.free_blocks, h.leases, h.running, h.waiting) == (free, 0, 0, 0):
            return
        if loop.time() > deadline:
            raise AssertionError(f"{c.address} still holds blocks: {h}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def decode_worker(tiny_model_path: Path) -> Iterator[tuple[asyncio.AbstractEventLoop, str]]:
    """A decode worker on its own event loop thread, for the property tests below."""
    import torch

    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    w = asyncio.run_coroutine_threadsafe(start(tiny_model_path, "decode"), loop).result(120)
    yield loop, w.address
    asyncio.run_coroutine_threadsafe(w.stop(0.2), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


COUNTS = st.integers(-3, 48) | st.sampled_from([2**31 - 1, -(2**31)])


@settings(max_examples=scaled(60), deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
# found by the search: an empty span whose payload was drawn one byte short of nothing
@example(layer=0, start_token=0, num_tokens=0, data_tokens=0, extra_bytes=-1, crc="none",
         same_compat=True, sized=False)  # fmt: skip
@example(layer=0, start_token=0, num_tokens=0, data_tokens=0, extra_bytes=-1, crc="right",
         same_compat=True, sized=True)  # fmt: skip
@given(
    layer=st.integers(-2, 6),
    start_token=COUNTS,
    num_tokens=COUNTS,
    data_tokens=st.integers(0, 48),
    extra_bytes=st.sampled_from([0, 0, 0, 1, -1, 7]),
    crc=st.sampled_from(["right", "wrong", "none"]),
    same_compat=st.booleans(),
    sized=st.booleans(),
)
# an empty span whose payload was cut to nothing: valid (0 bytes for 0 tokens)
@example(layer=0, start_token=0, num_tokens=0, data_tokens=0, extra_bytes=-1, crc="right",
         same_compat=True, sized=False)  # fmt: skip
@example(layer=0, start_token=40, num_tokens=1, data_tokens=1, extra_bytes=0, crc="none",
         same_compat=True, sized=True)  # fmt: skip
def test_any_kv_layer_is_placed_or_refused_clearly_and_never_leaks(
    decode_worker: tuple[asyncio.AbstractEventLoop, str], layer: int, start_token: int,
    num_tokens: int, data_tokens: int, extra_bytes: int, crc: str, same_compat: bool,
    sized: bool,
) -> None:  # fmt: skip
    loop, address = decode_worker
    if sized and 0 <= num_tokens <= 48:
        data_tokens = num_tokens  # the payload matches the count (the near-valid cases)

    async def one() -> None:
        async with WorkerClient(address, TOKEN) as d:
            h0 = await d.health()
            tb = 2 * h0.compat.kv_heads * h0.compat.head_dim * 4
            rid = f"prop-{os.urandom(4).hex()}"
            handle = await d.reserve(rid, 40, h0.compat)
            data = os.urandom(max(0, data_tokens * tb + extra_bytes))
            msg = pb.KVLayer(request_id=rid, lease_id=handle.lease_id, layer=layer,
                             start_token=start_token, num_tokens=num_tokens, data=data,
                             compat_hash=h0.compat.hash if same_compat else "f" * 64)  # fmt: skip
            if crc != "none":
                msg.crc32 = zlib.crc32(data) ^ (0 if crc == "right" else 1)
            # what the worker must accept: the payload is exactly the tokens' K and V
            valid = (same_compat and crc != "wrong" and 0 <= layer < h0.compat.num_layers
                     and num_tokens >= 0 and len(data) == num_tokens * tb
                     and start_token >= 0 and start_token + num_tokens <= 40)  # fmt: skip
            try:
                ack = await d.push_kv(pushes(msg)(), timeout=10)
            except grpc.aio.AioRpcError as e:
                assert e.code() in CLEAR and e.details(), (e.code(), e.details())
                assert not valid or num_tokens == 0, f"a valid span was refused: {e.details()}"
            else:
                assert valid, f"an invalid span was accepted: {msg.layer=} {msg.start_token=} "
                assert ack.bytes_received == len(data)
            await d.release(rid)
            await settle(d, h0.total_blocks, timeout=10)

    asyncio.run_coroutine_threadsafe(one(), loop).result(60)
