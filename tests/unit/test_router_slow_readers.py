"""A client that stops reading its stream costs only itself: past a bounded backlog its
request is ended on the workers (their KV freed) and its decode slot given back, while
its connection still waits for the bytes it does not read. The app is driven as uvicorn
drives it, with a ``send`` that never completes once the client stops reading."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

import pytest
from fastapi import FastAPI
from mem_workers import MemWorker, mem_router
from splitserve_worker.router.app import create_app
from splitserve_worker.router.config import QueueConfig
from splitserve_worker.router.dispatch import ATTEMPT_BUFFER
from tiny_models import tiny_tokenizer

pytestmark = pytest.mark.unit

GUARD_S = 20.0
BACKLOG = 32
MAX_TOKENS = 3000


def scope_of(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000), "state": {},
    }  # fmt: skip


async def until(predicate: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD_S
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("n", [1, 4])
async def test_a_client_that_stops_reading_frees_its_slot_and_the_workers_kv(n: int) -> None:
    worker = MemWorker("b1", "both")
    service = mem_router([worker], tiny_tokenizer(), queues=QueueConfig(max_stream_backlog=BACKLOG))
    app: FastAPI = create_app(service)
    body = json.dumps({"prompt": [1, 2], "max_tokens": MAX_TOKENS, "stream": True, "n": n,
                       "ignore_eos": True}).encode()  # fmt: skip
    chunks: list[bytes] = []
    stopped_reading = asyncio.Event()
    sent_request = False

    async def receive() -> MutableMapping[str, Any]:
        nonlocal sent_request
        if not sent_request:
            sent_request = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never hangs up
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if len(chunks) >= 3:  # the client read a little, then stopped
                stopped_reading.set()
                await asyncio.Event().wait()  # this write never completes

    async with app.router.lifespan_context(app):
        assert await service.wait_ready(GUARD_S)
        call = asyncio.create_task(app(scope_of("/v1/completions", body), receive, send))
        try:
            await asyncio.wait_for(stopped_reading.wait(), GUARD_S)
            stage = service.dispatcher.decode_stage
            await until(lambda: stage.active == 0, "the decode slots to be given back")
            await until(lambda: worker.streams_open == 0, "the worker's streams to end")
            assert not call.done(), "the response ended: the test's client is not stuck"
            # ended early on the worker, with every attempt cancelled there (its KV freed)
            assert worker.tokens_out < MAX_TOKENS, "the worker ran the whole request for nobody"
            # what the router holds for the client, and what it reads ahead of it
            assert worker.tokens_out <= BACKLOG + n * (ATTEMPT_BUFFER + 8), worker.tokens_out
            rids = {rid for rid, _, _ in worker.generated}
            assert len(rids) == n
            await until(lambda: rids <= set(worker.cancelled), "the cancels to reach the worker")
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
        assert service.dispatcher.decode_stage.active == 0
