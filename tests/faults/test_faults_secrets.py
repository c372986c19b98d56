"""No secret is logged: the worker token and the API key never appear in any output.

A stack runs with a known worker token and API key (router at debug level, with the
KV fault knob on so pushes fail and get retried); it serves good requests, refuses
requests without the key, bad requests and gRPC calls with a wrong token, and loses its
decode worker mid-stream. Then every line every process printed, every error body, and
every process's command line are searched for both secrets.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from splitserve.roles import Role
from splitserve_worker.client import WorkerClient
from splitserve_worker.kv.faults import ENV_FAIL, ENV_SEED

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_no_secret_in_any_log_line(tiny_model_path: Path, stack_factory: Any, kit: Any) -> None:
    token = "wtok-" + secrets.token_hex(12)
    api_key = "sk-" + secrets.token_hex(12)
    s = stack_factory(
        tiny_model_path,
        [Role.PREFILL, Role.DECODE],
        token=token,
        api_key=api_key,
        worker_env={ENV_FAIL: "0.2", ENV_SEED: "3"},
        router_log_level="debug",
    )
    pids = [s.router.pid, *(wp.proc.pid for wp in s.procs.procs)]
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in pids]
    bodies: list[str] = []

    async def go() -> None:
        outs = await kit.many_requests(s, [kit.prompt_of(9000 + i) for i in range(10)], 8, 60)
        assert all(o.completed for o in outs), kit.describe(outs)
        async with httpx.AsyncClient(timeout=30) as c:
            url = f"{s.base_url}/v1/completions"
            for headers in ({}, {"Authorization": "Bearer " + api_key[:-1]}):
                r = await c.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=headers)
                assert r.status_code == 401
                bodies.append(r.text)
            for body in ({"prompt": ""}, {"prompt": [10**6]}, {"prompt": "x", "max_tokens": -1},
                         {"prompt": "x", "bogus": 1}):  # fmt: skip
                r = await c.post(url, json=body, headers=s.headers())
                assert r.status_code == 400, r.text
                bodies.append(r.text)
        for i in range(2):
            async with WorkerClient(s.address(i), token + "-wrong", timeout=5) as bad:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await bad.health()
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
                bodies.append(str(e.value.details()))
        # lose the decode worker mid-stream: every request ends with an error
        run = asyncio.create_task(
            kit.many_requests(s, [kit.prompt_of(9100 + i) for i in range(10)], 200, 60)
        )
        while not (await s.health(1)).running:
            await asyncio.sleep(0.01)
        s.kill(1)
        outs = await run
        assert not any(o.hung for o in outs)
        bodies.extend(str(o.error_body) for o in outs if o.error_body)
        assert any(o.error for o in outs), "losing the only decode worker failed nothing"
        # the router's log reaches us through a pipe: wait until it told of the failures
        deadline = time.monotonic() + 30
        while not any("failed" in line for line in s.logs()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    asyncio.run(go())
    lines = s.logs()
    assert any("failed" in line for line in lines), "the failures were not logged at all"
    assert len(lines) > 20
    for secret in (token, api_key):
        for where, texts in (("log", lines), ("response", bodies)):
            leaked = [t for t in texts if secret in t]
            assert not leaked, f"a secret appears in a {where}: {leaked[:3]}"
        for cmd in cmdlines:
            assert secret.encode() not in cmd, f"a secret is on a command line: {cmd!r}"
