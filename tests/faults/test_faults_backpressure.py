"""Backpressure: a burst past the router's queues gets 429 with Retry-After, as an HTTP
status, never as an error inside a 200 stream; clients that leave early hold no slot.

A ``both`` worker and the router (uvicorn on 127.0.0.1) run in this process; the router
keeps 2 streams in flight and 3 waiting, and 30 streams arrive at once.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOKEN = "backpressure-token"


async def start(model: Path) -> tuple[Any, Any, Any, Any, str]:
    from splitserve.roles import Role
    from splitserve_worker.commands.router import load_tokenizer
    from splitserve_worker.commands.up import serve_router
    from splitserve_worker.models import load_model
    from splitserve_worker.router.app import create_app
    from splitserve_worker.router.config import RouterConfig
    from splitserve_worker.router.discovery import StaticDiscovery, WorkerEndpoint
    from splitserve_worker.router.service import RouterService
    from splitserve_worker.server.app import start_worker
    from splitserve_worker.server.config import WorkerConfig

    cfg = WorkerConfig(role="both", model=str(model), token=TOKEN, num_blocks=256, threads=1)
    w = await start_worker(cfg, loaded=load_model(str(model)))
    rcfg = RouterConfig.from_mapping({
        "model_name": "tiny", "worker_token": TOKEN,
        "queues": {"decode_slots_per_worker": 2, "decode_max_waiting": 3, "max_wait_s": 20.0,
                   "retry_after_s": 2}})  # fmt: skip
    ep = WorkerEndpoint(name=f"both@{w.address}", role=Role.BOTH, address=w.address)
    service = RouterService(rcfg, load_tokenizer(str(model)), StaticDiscovery([ep]))
    server, task, port = await serve_router(create_app(service), "127.0.0.1", 0)
    assert await service.wait_ready(30)
    return w, service, server, task, f"http://127.0.0.1:{port}"


async def stream(c: httpx.AsyncClient, url: str, i: int) -> tuple[int, str, dict[str, str]]:
    body = {"prompt": [1, 5 + i, 9, 12], "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    async with c.stream("POST", url, json=body) as r:
        return r.status_code, (await r.aread()).decode(), dict(r.headers)


def test_a_burst_past_the_queues_gets_429_not_an_error_inside_a_200(
    tiny_model_path: Path,
) -> None:
    async def scenario() -> None:
        w, service, server, task, base = await start(tiny_model_path)
        stage = service.dispatcher.decode_stage
        try:
            url = f"{base}/v1/completions"
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
                answers = await asyncio.gather(*(stream(c, url, i) for i in range(30)))
                ok = throttled = 0
                for status, text, headers in answers:
                    if status == 200:
                        events = [json.loads(ln[6:]) for ln in text.splitlines()
                                  if ln.startswith("data: {")]  # fmt: skip
                        assert not [e for e in events if "error" in e], text[-400:]
                        assert events[-1]["choices"][0]["finish_reason"] == "length"
                        assert text.rstrip().endswith("data: [DONE]")
                        ok += 1
                    else:
                        assert status == 429, (status, text)
                        assert headers.get("retry-after") == "2"
                        err = json.loads(text)["error"]
                        assert err["code"] == "queue_full" and "queue" in err["message"]
                        throttled += 1
                assert ok >= 5 and throttled >= 1, (ok, throttled)
                # clients that hang up at once, before or while streaming, leave no slot held
                for i in range(10):
                    req = c.build_request("POST", url, json={
                        "prompt": [1, 2, 3 + i], "max_tokens": 200, "ignore_eos": True,
                        "stream": True})  # fmt: skip
                    r = await c.send(req, stream=True)
                    await r.aclose()
            for _ in range(200):
                if stage.active == 0 and stage.waiting == 0:
                    break
                await asyncio.sleep(0.05)
            assert (stage.active, stage.waiting) == (0, 0), "a decode slot leaked"
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)
            await w.stop(0.2)

    asyncio.run(scenario())
