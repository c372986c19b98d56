"""What tests that drive worker processes over gRPC share: prompts, draining a Generate
stream, one request split across a prefill and a decode worker, and waiting for a
worker's pool to come back whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient


def prompt_of(n: int) -> list[int]:
    return [3 + (i * 37 + n) % 250 for i in range(n)]


async def collect(stream: AsyncIterator[pb.TokenChunk]) -> list[int]:
    out: list[int] = []
    async for c in stream:
        out += list(c.token_ids)
    return out


async def split_request(
    p: WorkerClient,
    d: WorkerClient,
    rid: str,
    prompt: list[int],
    sp: pb.SamplingParams,
    backend: str = "grpc",
    **prefill_kw: Any,
) -> tuple[list[int], pb.PrefillResponse]:
    """``prompt`` prefilled on ``p``, its KV moved over ``backend`` and decoded on ``d``:
    the tokens ``d`` streamed and ``p``'s PrefillResponse."""
    handle = await d.reserve(rid, len(prompt), (await p.health()).compat, kv_backend=backend)
    assert handle.kv_backend == backend
    gen = asyncio.ensure_future(collect(d.generate(rid, prompt, sp, expect_remote_kv=True)))
    try:
        resp = await p.prefill(rid, prompt, sp, handle, **prefill_kw)
    except BaseException:
        gen.cancel()
        raise
    return await gen, resp


async def all_free(c: WorkerClient, timeout: float = 10.0) -> pb.HealthResponse:
    """The worker's health once every block is free and no lease is held, or at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        h = await c.health()
        if (h.free_blocks == h.total_blocks and h.leases == 0) or time.monotonic() > deadline:
            return h
        await asyncio.sleep(0.1)
