"""Workers fail while 50 requests are in flight; every request still ends, no block leaks.

One stack (two prefill, three decode workers, the router; real processes on 127.0.0.1)
goes through the faults in order: the router's connections to a decode worker are cut,
a decode worker is frozen (SIGSTOP) past its lease and thawed, a prefill worker is
killed mid-prefill, a decode worker is killed mid-transfer, another mid-stream. Each kill
-9 hits a worker held at a named point (``kv.faults.Holds``: half a push sent, half a push
received, a stream after its first tokens) and comes right after a SIGSTOP. After
each: no request hangs, each one completed with the right greedy tokens or ended with a
clear error in the OpenAI shape, and every surviving worker is back to its starting
free-block count with no lease, running or waiting request left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from splitserve_worker.server.client import WorkerClient

pytestmark = [pytest.mark.slow, pytest.mark.integration]

N = 50
MAX_TOKENS = 48
BOUND_S = 45.0
"""No request may take longer than this (lease 3 s, inter-token timeout 3 s, 3 retries)."""

PREFILL = (0, 1)
DECODE = (2, 3, 4)


async def wait_for(pred: Callable[[], Awaitable[Any]], timeout: float, what: str) -> Any:
    """Polls ``pred`` until it returns something truthy, which it returns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        if RUN and RUN[-1].done():
            outcomes = RUN[-1].result()
            raise AssertionError(
                f"every request ended before {what} was seen: "
                f"{sum(o.completed for o in outcomes)} of {len(outcomes)} completed; "
                + "; ".join(f"#{o.index} {o.status} {o.error!r}" for o in outcomes[:3])
            )
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


RUN: list[asyncio.Task[Any]] = []
"""The scenario's running batch of requests (so a wait can tell it ended already)."""


def check(outcomes: list[Any], expected: list[list[int]], kit: Any) -> int:
    """Asserts the promises; returns how many requests completed."""
    hung = [o.index for o in outcomes if o.hung]
    assert not hung, f"requests {hung} hung past {BOUND_S} s: {kit.describe(outcomes)}"
    done = 0
    for o in outcomes:
        if o.completed:
            assert o.tokens == expected[o.index], f"request {o.index} got wrong tokens"
            done += 1
        else:
            assert o.error, f"request {o.index} ended without tokens or an error: {o}"
            err = (o.error_body or {}).get("error", {})
            assert err.get("message") and err.get("type"), f"not an OpenAI error: {o}"
    return done


async def scenario(
    stack: Any, kit: Any, model: Path, salt: int, fault: Callable[[], Awaitable[None]]
) -> tuple[list[Any], dict[int, Any], dict[str, int]]:
    prompts = [kit.prompt_of(salt * 1000 + i) for i in range(N)]
    expected = await asyncio.to_thread(kit.reference_tokens, model, prompts, MAX_TOKENS)
    await stack.wait_router_sees(stack.survivors())
    base = await stack.baseline_of(stack.survivors())
    run = asyncio.create_task(kit.many_requests(stack, prompts, MAX_TOKENS, BOUND_S))
    RUN.append(run)
    try:
        await fault()
    finally:
        outcomes = await run
    done = check(outcomes, expected, kit)
    settled = await stack.wait_settled(base)
    for i, h in settled.items():
        assert (h.free_blocks, h.leases, h.running, h.waiting) == (base[i], 0, 0, 0), (
            f"worker {i} ({stack.roles[i].value}) still holds something: free "
            f"{h.free_blocks}/{base[i]}, leases {h.leases}, running {h.running}, "
            f"waiting {h.waiting}"
        )
    assert set(settled) == set(stack.survivors()), "a surviving worker stopped answering Health"
    return outcomes, settled, {"done": done}


def test_router_connection_to_a_decode_worker_dropped(
    fault_stack: Any, kit: Any, tiny_model_path: Path
) -> None:
    s = fault_stack
    d = DECODE[0]

    async def fault() -> None:
        await _watch(s, (d,), lambda h: h.running > 0, "a request streaming on the decode worker")
        assert s.relays[d].drop() > 0

    async def go() -> None:
        outs, _, n = await scenario(s, kit, tiny_model_path, 1, fault)
        assert n["done"] == N, kit.describe(outs)

    asyncio.run(go())


def test_decode_worker_frozen_past_its_lease(
    fault_stack: Any, kit: Any, tiny_model_path: Path
) -> None:
    s = fault_stack
    d = DECODE[1]

    async def fault() -> None:
        await _watch(s, (d,), lambda h: h.running > 0, "a request streaming on the decode worker")
        s.freeze(d)
        await asyncio.sleep(2 * kit.lease_s + 1)
        s.thaw(d)

    async def go() -> None:
        outs, _, n = await scenario(s, kit, tiny_model_path, 2, fault)
        assert n["done"] == N, kit.describe(outs)
        assert d in s.survivors()

    asyncio.run(go())


def test_prefill_worker_killed_mid_prefill(
    fault_stack: Any, kit: Any, tiny_model_path: Path
) -> None:
    s = fault_stack
    p = PREFILL[0]

    async def fault() -> None:
        # the worker stops once a prompt's first layer went out, and dies there
        await _kill_at(s, (p,), "push", "a push half sent by the prefill worker")

    async def go() -> None:
        before = await kit.router_metric(s, "splitserve_router_retries_total")
        mark = len(s.router_lines)
        outs, _, n = await scenario(s, kit, tiny_model_path, 3, fault)
        assert n["done"] == N, kit.describe(outs)
        assert p not in s.survivors()
        after = await kit.router_metric(s, "splitserve_router_retries_total")
        seen = [ln for ln in s.router_lines[mark:] if "failed (" in ln]
        assert sum(after.values()) > sum(before.values()), f"none retried: {after}; {seen[-12:]}"

    asyncio.run(go())


def test_decode_worker_killed_mid_transfer(
    fault_stack: Any, kit: Any, tiny_model_path: Path
) -> None:
    s = fault_stack
    killed: list[int] = []

    async def fault() -> None:
        # the first decode worker that wrote part of a push dies right there
        live = tuple(i for i in DECODE if i in s.survivors())
        killed.append(await _kill_at(s, live, "receive", "a push half received"))

    async def go() -> None:
        before = await kit.router_metric(s, "splitserve_router_retries_total")
        outs, _, n = await scenario(s, kit, tiny_model_path, 4, fault)
        assert n["done"] == N, kit.describe(outs)
        assert killed and killed[0] not in s.survivors()
        after = await kit.router_metric(s, "splitserve_router_retries_total")
        assert sum(after.values()) > sum(before.values()), f"none retried: {after}"

    asyncio.run(go())


def test_decode_worker_killed_mid_stream(fault_stack: Any, kit: Any, tiny_model_path: Path) -> None:
    s = fault_stack
    live = tuple(i for i in DECODE if i in s.survivors())
    assert len(live) >= 2, "an earlier scenario left fewer than two decode workers"

    async def fault() -> None:
        # the first decode worker to have sent a stream's first tokens dies right there
        await _kill_at(s, live, "stream", "a stream held after its first tokens")

    async def go() -> None:
        before = await kit.router_metric(s, "splitserve_router_retries_total")
        mark = len(s.router_lines)
        outs, _, n = await scenario(s, kit, tiny_model_path, 5, fault)
        assert n["done"] == N, kit.describe(outs)
        after = await kit.router_metric(s, "splitserve_router_retries_total")
        migrated = after.get('{reason="migrate"}', 0) - before.get('{reason="migrate"}', 0)
        seen = [ln for ln in s.router_lines[mark:] if "failed (" in ln]
        assert migrated > 0, f"no request migrated: {before} -> {after}; {seen[-12:]}"

    asyncio.run(go())


def freeze_then_kill(s: Any, i: int) -> None:
    """SIGSTOP at once (what it was doing when seen stays half done), then SIGKILL."""
    s.freeze(i)
    s.kill(i)
    s.stopped.discard(i)


async def _watch(s: Any, workers: tuple[int, ...], pred: Callable[[Any], bool], what: str) -> int:
    """Waits for a worker of ``workers`` whose Health shows ``pred``; returns its index.

    Each watched worker is polled on its own, over one channel, as fast as it answers: on
    the tiny model a handoff lasts milliseconds, and waiting for the slowest of several
    busy workers before polling again (or opening a channel per call) can miss them all."""
    live = [i for i in workers if i in s.survivors()]
    clients = {i: WorkerClient(s.address(i), s.token, timeout=2.0) for i in live}
    hit: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    polls = dict.fromkeys(live, 0)
    last: dict[int, str] = {}

    async def poll(i: int, c: WorkerClient) -> None:
        while not hit.done():
            try:
                h = await c.health()
            except Exception as e:  # a busy or dying worker: say so, keep polling
                last[i] = repr(e)[:120]
                await asyncio.sleep(0.005)
                continue
            polls[i] += 1
            last[i] = f"running {h.running} leases {h.leases} prefilling {h.prefilling}"
            if pred(h) and not hit.done():
                hit.set_result(i + 1)  # truthy even for index 0

    async def seen() -> int | None:
        return hit.result() if hit.done() else None

    tasks = [asyncio.create_task(poll(i, c)) for i, c in clients.items()]
    try:
        return int(await wait_for(seen, 20, what)) - 1
    except AssertionError as e:
        raise AssertionError(f"{e} (polls {polls}; last: {last})") from None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients.values():
            await c.close()


async def _kill_at(s: Any, workers: tuple[int, ...], point: str, what: str) -> int:
    """Arms hold ``point`` on ``workers``; the first to stop there is killed (the others
    go on) and returned."""
    armed = [s.hold(i, point) for i in workers]
    try:

        async def seen() -> int | None:
            return next((i + 1 for i in workers if s.reached(i, point)), None)  # 0 is falsy

        i = int(await wait_for(seen, 20, what)) - 1
        freeze_then_kill(s, i)
        return i
    finally:
        for f in armed:
            f.unlink(missing_ok=True)
