"""The tcp KV port of a real decode worker under garbage: random and truncated frames,
oversized lengths, wrong tokens and compat hashes, spans aimed at a live reservation
with random fields, and thousands of short-lived connections.

A prefill and a decode worker (the tiny model) run in-process on 127.0.0.1. Whatever
comes in, the decode worker stays up, no connection thread outlives its connection, a
completion over the tcp backend afterwards gives the tokens it gave before, and the
free-block count returns to where it started. The search is derandomized (the same
cases every run, plus the explicit examples); run with ``--hypothesis-seed`` and more
examples to search further.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.kv import tcp_wire as wire
from splitserve_worker.server.app import RunningWorker, start_worker
from splitserve_worker.server.config import WorkerConfig
from worker_kit import collect, prompt_of, split_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "fuzz-tcp-token"
SP = pb.SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = prompt_of(70)


@dataclass
class Stack:
    loop: asyncio.AbstractEventLoop
    prefill: RunningWorker
    decode: RunningWorker
    kv_port: int
    compat_hash: str
    token_bytes: int
    num_layers: int
    free_blocks: int
    reference: list[int]

    def run(self, coro: object, timeout: float = 120) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]


def conn_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-tcp-conn"]


@pytest.fixture(scope="module")
def stack(tiny_model_path: Path) -> Iterator[Stack]:
    import torch
    from splitserve_worker.models import load_model

    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def up() -> Stack:
        ws = []
        for role in ("prefill", "decode"):
            cfg = WorkerConfig(role=role, model=str(tiny_model_path), token=TOKEN,  # type: ignore[arg-type]
                               num_blocks=200, threads=1, checksums=True)  # fmt: skip
            ws.append(await start_worker(cfg, loaded=load_model(str(tiny_model_path))))
        async with WorkerClient(ws[1].address, TOKEN) as d:
            h = await d.health()
            handle = await d.reserve("probe", 4, h.compat)
            await d.release("probe")
            reference = await collect(d.generate("ref", PROMPT, SP))
        port, tls = wire.parse_metadata(handle.backend_metadata)
        assert handle.kv_backend == "tcp" and not tls
        tb = 2 * h.compat.kv_heads * h.compat.head_dim * 4
        return Stack(loop, ws[0], ws[1], port, h.compat.hash, tb, h.compat.num_layers,
                     h.total_blocks, reference)  # fmt: skip

    s = asyncio.run_coroutine_threadsafe(up(), loop).result(180)
    yield s

    async def down() -> None:
        await s.prefill.stop(0.2)
        await s.decode.stop(0.2)

    asyncio.run_coroutine_threadsafe(down(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


async def settled(address: str, free: int, timeout: float = 15.0) -> pb.HealthResponse:
    deadline = time.monotonic() + timeout
    async with WorkerClient(address, TOKEN) as c:
        while True:
            h = await c.health()
            if (h.free_blocks, h.leases, h.running, h.waiting) == (free, 0, 0, 0):
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"{address} still holds blocks: {h}")
            await asyncio.sleep(0.05)


def poke(port: int, stages: list[bytes | str], timeout: float = 10.0) -> bool:
    """Connect, play ``stages`` (bytes to send; ``"hello"``/``"bad-token"``/``"bad-compat"``
    answer the challenge; ``"read"`` reads what came), half-close, and read until the port
    closes: True once it has (False if it was still open at ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        got = b""
        try:
            for stage in stages:
                if isinstance(stage, bytes):
                    s.sendall(stage)
                    continue
                while len(got) < wire.ANSWER.size:
                    chunk = s.recv(4096)
                    if not chunk:
                        return True
                    got += chunk
                if stage == "read":
                    continue
                answer = wire.parse_answer(got[: wire.ANSWER.size])
                if answer.kind != wire.CHALLENGE:
                    return True  # turned away (over the limits)
                got = got[wire.ANSWER.size :]
                token = "not-the-token" if stage == "bad-token" else TOKEN
                compat = ("f" * 64) if stage == "bad-compat" else STACK_HASH[0]
                s.sendall(wire.hello(token, answer.nonce, compat))
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            pass
        return True


STACK_HASH = [""]
"""The decode worker's compat hash, for :func:`poke` (set by the tests)."""


def frame(kind: int, lease: bytes, layer: int, start: int, count: int, nbytes: int,
          flags: int = 0, crc: int = 0) -> bytes:  # fmt: skip
    return wire.FRAME.pack(kind, flags, 0, 0, lease, layer, start, count, nbytes, crc)


U32 = st.integers(0, 2**32 - 1)
SMALL = st.integers(0, 64) | U32


QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(derandomize=True, max_examples=150, deadline=None, suppress_health_check=QUIET)
@given(
    before=st.sampled_from(["nothing", "hello", "bad-token", "bad-compat"]),
    aim=st.sampled_from(["live lease", "unknown lease", "random lease"]),
    layer=SMALL,
    start=SMALL,
    count=SMALL,
    nbytes=st.integers(0, 64)
    | st.sampled_from([wire.MAX_SPAN_BYTES, wire.MAX_SPAN_BYTES + 1, 2**32 - 1]),
    payload=st.sampled_from(["exact", "short", "none", "long"]),
    flags=st.sampled_from([0, 0, 1, 2]),
    trailer=st.binary(max_size=200),
    cut=st.none() | st.integers(0, 400),
)
@example(
    before="hello",
    aim="live lease",
    layer=0,
    start=0,
    count=1,
    nbytes=0,
    payload="none",
    flags=0,
    trailer=b"",
    cut=None,
)  # a span of the right count but no bytes
@example(
    before="hello",
    aim="live lease",
    layer=0,
    start=0,
    count=1,
    nbytes=wire.MAX_SPAN_BYTES + 1,
    payload="none",
    flags=0,
    trailer=b"",
    cut=None,
)
@example(
    before="hello",
    aim="live lease",
    layer=0,
    start=39,
    count=2,
    nbytes=0,
    payload="exact",
    flags=0,
    trailer=b"",
    cut=None,
)  # past the reservation
@example(
    before="bad-token",
    aim="live lease",
    layer=0,
    start=0,
    count=1,
    nbytes=0,
    payload="exact",
    flags=0,
    trailer=b"",
    cut=None,
)
@example(
    before="nothing",
    aim="live lease",
    layer=0,
    start=0,
    count=1,
    nbytes=0,
    payload="exact",
    flags=0,
    trailer=b"",
    cut=None,
)  # a span where the hello goes
@example(
    before="hello",
    aim="live lease",
    layer=0,
    start=0,
    count=1,
    nbytes=0,
    payload="exact",
    flags=0,
    trailer=b"",
    cut=45,
)  # cut inside the payload
def test_any_frames_end_their_own_connection_and_leak_nothing(
    stack: Stack, before: str, aim: str, layer: int, start: int, count: int, nbytes: int,
    payload: str, flags: int, trailer: bytes, cut: int | None,
) -> None:  # fmt: skip
    STACK_HASH[0] = stack.compat_hash
    d = stack.decode.address

    rid = f"fz-{os.urandom(4).hex()}"

    async def reserve() -> str:
        async with WorkerClient(d, TOKEN) as c:
            return str((await c.reserve(rid, 40, (await c.health()).compat)).lease_id)

    lease_id = str(stack.run(reserve()))
    lease = {"live lease": lease_id.encode(), "unknown lease": b"f" * 16,
             "random lease": os.urandom(16)}[aim]  # fmt: skip
    right = 2 * count * stack.token_bytes if count <= 64 else 0
    size = nbytes or right
    sent = min(size, 1 << 16)  # at most 64 KiB of a claimed length actually comes
    body = {"exact": os.urandom(sent), "short": os.urandom(sent // 2), "none": b"",
            "long": os.urandom(sent + 9)}[payload]  # fmt: skip
    crc = zlib.crc32(body) if flags == 1 else 0
    blob = frame(wire.SPAN, lease, layer, start, count, size, flags, crc) + body + trailer
    if cut is not None:
        blob = blob[:cut]
    stages: list[bytes | str] = ([] if before == "nothing" else [before]) + [blob]
    assert poke(stack.kv_port, stages), "the port kept a bad connection open"

    async def release() -> None:
        # a valid span was placed, a refused one freed its blocks: either way nothing is
        # held once the reservation is released
        async with WorkerClient(d, TOKEN) as c:
            assert (await c.health()).role == pb.ROLE_DECODE  # still serving
            await c.release(rid)
        await settled(d, stack.free_blocks)

    stack.run(release())


def test_thousands_of_short_connections_then_a_completion_as_before(stack: Stack) -> None:
    STACK_HASH[0] = stack.compat_hash
    kinds: list[list[bytes | str]] = [
        [],  # connect and close
        ["read"],  # take the challenge, say nothing
        ["bad-token"],
        ["bad-compat"],
        [os.urandom(40)],  # garbage where the hello goes
        ["hello", os.urandom(40)],  # garbage where a frame goes
        ["hello", frame(wire.SPAN, b"f" * 16, 0, 0, 1, wire.MAX_SPAN_BYTES + 1)],
        ["hello", frame(wire.END, b"f" * 16, 0, 0, 0, 0)],
    ]
    for i in range(2000):
        assert poke(stack.kv_port, kinds[i % len(kinds)]), f"connection {i} stayed open"
    deadline = time.monotonic() + 10
    while conn_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not conn_threads(), "connection threads outlived their connections"

    async def after() -> None:
        await settled(stack.decode.address, stack.free_blocks)
        async with WorkerClient(stack.prefill.address, TOKEN) as p, \
                WorkerClient(stack.decode.address, TOKEN) as d:  # fmt: skip
            got, resp = await split_request(p, d, "after-fuzz", PROMPT, SP, backend="tcp")
            assert got == stack.reference and resp.first_token == stack.reference[0]
        await settled(stack.decode.address, stack.free_blocks)
        await settled(stack.prefill.address, (await _total(stack.prefill.address)))

    stack.run(after(), timeout=180)
    # what is left is the prefill worker's pooled connection, kept for its next push
    assert len(conn_threads()) <= 1


async def _total(address: str) -> int:
    async with WorkerClient(address, TOKEN) as c:
        return int((await c.health()).total_blocks)
