"""Failures with real worker processes: a killed prefill worker, a decode worker lost before
the first token, one lost mid-stream (migration), and a client that disconnects (every
worker's KV is freed). The mid-stream kill and the hang-ups happen while the worker is
stopped at its ``stream`` hold point (``SPLITSERVE_FAULT_HOLD_DIR``: after a stream's
first tokens), so they land mid-stream however fast the machine decodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
from hold_points import HoldPoints
from splitserve.roles import Role
from splitserve_worker.client import WorkerClient
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.router.config import (
    QueueConfig,
    RouterConfig,
    TimeoutConfig,
)
from splitserve_worker.router.discovery import StaticDiscovery, WorkerEndpoint
from splitserve_worker.router.local import RouterThread
from splitserve_worker.router.service import RouterService

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [(i * 31) % 200 + 3 for i in range(40)]
ALWAYS_REMOTE = "always"  # disaggregate every request these stacks can
# The router polls Health rarely here, so it learns of a dead worker only from a failed call.
SLOW_HEALTH = TimeoutConfig(health_interval_s=120.0, connect_s=3.0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


@pytest.fixture(scope="module")
def hf_model(tiny_model_path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        pad_token_id=0,
    )  # fmt: skip
    return list(out[0, len(prompt) :].tolist())


class Stack:
    def __init__(self, model: Path, roles: list[Role], holds: HoldPoints) -> None:
        self.token = secrets.token_hex(8)
        self.holds = holds
        self.procs = WorkerProcs(str(model), roles, self.token, threads=1, echo=False)
        with mock.patch.dict(os.environ, holds.env()):
            self.endpoints = self.procs.start(timeout_s=300)

    def pid(self, ep: WorkerEndpoint) -> int:
        return self.procs.procs[self.index(ep)].proc.pid

    def by_pid(self, pid: int) -> WorkerEndpoint:
        return next(ep for ep in self.endpoints if self.pid(ep) == pid)

    @contextlib.contextmanager
    def router(self, tokenizer: Any, eps: list[WorkerEndpoint], **cfg: Any) -> Iterator[str]:
        """A router over ``eps``, once it has seen every one of them healthy: a router
        ready as soon as one decode worker answers may not yet know a worker a test then
        kills, and would route around it instead of failing over from it."""
        config = RouterConfig(model_name="tiny", worker_token=self.token, **cfg)
        with RouterThread(RouterService(config, tokenizer, StaticDiscovery(eps))) as base:
            want = {e.name for e in eps}
            deadline = time.monotonic() + 120
            seen: set[str] = set()
            while seen != want:
                assert time.monotonic() < deadline, f"the router saw {seen} of {want} healthy"
                time.sleep(0.05)
                seen = {w["name"] for w in httpx.get(f"{base}/health").json()["workers"]
                        if w["healthy"]}  # fmt: skip
            yield base

    def index(self, ep: WorkerEndpoint) -> int:
        return self.endpoints.index(ep)

    def kill(self, ep: WorkerEndpoint) -> None:
        self.procs.kill(self.index(ep), signal.SIGKILL)

    def free_blocks(self, eps: list[WorkerEndpoint]) -> dict[str, tuple[int, int]]:
        async def one(ep: WorkerEndpoint) -> tuple[int, int]:
            conn = WorkerClient(ep.address, self.token)
            try:
                h = await conn.health(5.0)
                return h.free_blocks, h.running + h.waiting
            finally:
                await conn.close()

        async def all_() -> dict[str, tuple[int, int]]:
            return {ep.name: await one(ep) for ep in eps}

        return asyncio.run(all_())

    def settled(
        self, eps: list[WorkerEndpoint], want: dict[str, tuple[int, int]], timeout: float = 30
    ) -> dict[str, tuple[int, int]]:
        """:meth:`free_blocks` once it equals ``want``, or as it is at ``timeout``."""
        deadline = time.monotonic() + timeout
        now = self.free_blocks(eps)
        while now != want and time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.free_blocks(eps)
        return now


@pytest.fixture
def stack_factory(tiny_model_path: Path, tmp_path: Path) -> Iterator[Any]:
    made: list[Stack] = []

    def make(roles: list[Role]) -> Stack:
        s = Stack(tiny_model_path, roles, HoldPoints(tmp_path / f"holds-{len(made)}"))
        made.append(s)
        return s

    yield make
    for s in made:
        s.procs.stop()


def first_by_name(eps: list[WorkerEndpoint], role: Role) -> WorkerEndpoint:
    """The worker the router picks first among equals (ties go by name)."""
    return min((e for e in eps if e.role is role), key=lambda e: e.name)


def metric(base: str, name: str, label: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(rf'{name}\{{reason="{label}"\}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def complete(base: str, prompt: list[int], n: int) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=120,
    )


def test_prefill_worker_killed_retries_on_another(
    stack_factory: Any, tokenizer: Any, hf_model: Any
) -> None:
    st = stack_factory([Role.PREFILL, Role.PREFILL, Role.DECODE])
    dead = first_by_name(st.endpoints, Role.PREFILL)
    decode = [e for e in st.endpoints if e.role is Role.DECODE]
    with st.router(
        tokenizer, st.endpoints, disaggregation=ALWAYS_REMOTE, timeouts=SLOW_HEALTH
    ) as base:
        before = st.free_blocks(decode)
        st.kill(dead)
        r = complete(base, PROMPT, 8)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy(hf_model, PROMPT, 8)
        assert metric(base, "splitserve_router_retries_total", "prefill_failed") == 1
        health = {w["name"]: w["healthy"] for w in httpx.get(f"{base}/health").json()["workers"]}
        assert health[dead.name] is False
        # the decode worker holds nothing for the failed attempt (the router cancels
        # its reservation in the background: wait for that, then compare)
        assert st.settled(decode, before) == before


def test_decode_lost_before_first_token_retries_then_clear_error(
    stack_factory: Any, tokenizer: Any, hf_model: Any
) -> None:
    st = stack_factory([Role.BOTH, Role.BOTH])
    dead = first_by_name(st.endpoints, Role.BOTH)
    cfg = {"timeouts": SLOW_HEALTH, "queues": QueueConfig(max_wait_s=2.0)}
    with st.router(tokenizer, st.endpoints, **cfg) as base:
        st.kill(dead)
        r = complete(base, PROMPT, 6)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy(hf_model, PROMPT, 6)
        assert metric(base, "splitserve_router_retries_total", "decode_lost") == 1
        # the last worker goes too: the client gets a clear error, in bounded time
        st.kill(next(e for e in st.endpoints if e != dead))
        t0 = time.monotonic()
        r = complete(base, PROMPT, 6)
        assert r.status_code in (502, 503)
        assert "worker" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 30


PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2}


@pytest.mark.parametrize("penalties", [{}, PENALTIES], ids=["plain", "penalties"])
def test_decode_lost_mid_stream_migrates_with_identical_tokens(
    stack_factory: Any, tokenizer: Any, hf_model: Any, penalties: dict[str, float]
) -> None:
    """With penalties too: the worker that takes over counts the tokens already streamed
    as output, not as prompt."""
    st = stack_factory([Role.BOTH, Role.BOTH])
    n = 300
    want = greedy(hf_model, PROMPT, n)
    with st.router(tokenizer, st.endpoints, timeouts=SLOW_HEALTH) as base:
        body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": True, **penalties}  # fmt: skip
        if penalties:
            r = httpx.post(f"{base}/v1/completions", json={**body, "stream": False}, timeout=120)
            assert r.status_code == 200, r.text
            uninterrupted = r.json()["choices"][0]["token_ids"]
            assert uninterrupted != want, "the penalties change no token"
            want = uninterrupted
        got: list[int] = []
        killed: WorkerEndpoint | None = None
        pids = [st.pid(e) for e in st.endpoints]
        with (
            st.holds.armed(pids, "stream"),
            httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                got += chunk["choices"][0].get("token_ids", [])
                if killed is None and got:
                    # the worker streaming it stops after its first tokens: killed there
                    killed = st.by_pid(st.holds.wait_reached(pids, "stream"))
                    busy = [w["name"] for w in httpx.get(f"{base}/health").json()["workers"]
                            if w["assigned"] > 0]  # fmt: skip
                    assert busy == [killed.name], busy
                    st.kill(killed)
                    for pid in pids:  # the worker it moves to streams on
                        st.holds.release(pid, "stream")
        assert killed is not None
        assert len(got) == n
        assert got == want
        assert metric(base, "splitserve_router_retries_total", "migrate") == 1


def test_client_disconnect_frees_kv_on_every_worker(stack_factory: Any, tokenizer: Any) -> None:
    st = stack_factory([Role.PREFILL, Role.DECODE, Role.BOTH])
    pd = [e for e in st.endpoints if e.role is not Role.BOTH]
    both = [e for e in st.endpoints if e.role is Role.BOTH]
    before = st.free_blocks(st.endpoints)
    assert all(busy == 0 for _, busy in before.values())
    body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    pids = [st.pid(e) for e in st.endpoints]

    async def hang_up_mid_stream(base: str, n: int) -> None:
        """A non-streamed request of ``n`` choices, given up by its client once a worker
        is stopped mid-stream on it."""
        async with httpx.AsyncClient(timeout=60) as client:
            call = asyncio.ensure_future(
                client.post(f"{base}/v1/completions", json={**body, "stream": False, "n": n})
            )
            try:
                await st.holds.wait_reached_async(pids, "stream", gave_up=call.done)
            finally:
                call.cancel()  # the client hangs up: the connection closes
            with pytest.raises(asyncio.CancelledError):
                await call

    with (
        st.router(tokenizer, pd, disaggregation=ALWAYS_REMOTE) as remote_base,
        st.router(tokenizer, both) as local_base,
    ):
        for base in (remote_base, local_base):
            # streaming: the worker stops after the first tokens, the client leaves there
            with (
                st.holds.armed(pids, "stream"),
                httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get(
                        "token_ids"
                    ):
                        st.holds.wait_reached(pids, "stream")
                        break  # leaving the block closes the connection mid-stream
            # non-streaming, one choice or two: the client gives up while they run
            for n in (1, 2):
                with st.holds.armed(pids, "stream"):
                    asyncio.run(hang_up_mid_stream(base, n))
        assert st.settled(st.endpoints, before) == before
