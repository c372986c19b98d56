"""Workers fail while 50 requests are in flight; every request still ends, no block leaks.

Each scenario starts from a whole stack (two prefill, three decode workers, the router;
real processes on 127.0.0.1): the one the previous scenario left if every worker is
alive, idle and seen healthy by the router, else a fresh one. The faults: the router's
connections to a decode worker are cut,
a decode worker is frozen (SIGSTOP) past its lease and thawed, a prefill worker is
killed mid-prefill, a decode worker is killed mid-transfer, another mid-stream. Each fault
hits the first worker the router used that stopped at a named point (``kv.faults.Holds``:
half a push sent, half a push received, a stream after its first tokens; every worker of
the role is armed, the others go on), and each kill -9 comes right after a SIGSTOP. After
each: no request hangs, each one completed with the right greedy tokens or ended with a
clear error in the OpenAI shape, and every surviving worker is back to its starting
free-block count with no lease, running or waiting request left.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

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
    assert stack.survivors() == list(range(len(stack.relays))), "not a whole stack"
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

    async def fault() -> None:
        live = tuple(i for i in DECODE if i in s.survivors())
        async with _held(s, live, "stream", "a stream held after its first tokens") as d:
            assert s.relays[d].drop() > 0

    async def go() -> None:
        outs, _, n = await scenario(s, kit, tiny_model_path, 1, fault)
        assert n["done"] == N, kit.describe(outs)

    asyncio.run(go())


def test_decode_worker_frozen_past_its_lease(
    fault_stack: Any, kit: Any, tiny_model_path: Path
) -> None:
    s = fault_stack
    frozen: list[int] = []

    async def fault() -> None:
        live = tuple(i for i in DECODE if i in s.survivors())
        async with _held(s, live, "stream", "a stream held after its first tokens") as d:
            s.freeze(d)
            frozen.append(d)
        await asyncio.sleep(2 * kit.lease_s + 1)
        s.thaw(d)

    async def go() -> None:
        outs, _, n = await scenario(s, kit, tiny_model_path, 2, fault)
        assert n["done"] == N, kit.describe(outs)
        assert frozen and frozen[0] in s.survivors()

    asyncio.run(go())


def test_prefill_worker_killed_mid_prefill(
    fault_stack: Any, kit: Any, tiny_model_path: Path
) -> None:
    s = fault_stack
    killed: list[int] = []

    async def fault() -> None:
        # the first prefill worker that sent a prompt's first layer dies right there
        live = tuple(i for i in PREFILL if i in s.survivors())
        killed.append(await _kill_at(s, live, "push", "a push half sent"))

    async def go() -> None:
        before = await kit.router_metric(s, "splitserve_router_retries_total")
        mark = len(s.router_lines)
        outs, _, n = await scenario(s, kit, tiny_model_path, 3, fault)
        assert n["done"] == N, kit.describe(outs)
        assert killed and killed[0] not in s.survivors()
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
    assert live == DECODE, "the scenario did not start from a whole stack"

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


@contextlib.asynccontextmanager
async def _held(s: Any, workers: tuple[int, ...], point: str, what: str) -> AsyncIterator[int]:
    """Arms hold ``point`` on ``workers`` and yields the first to stop there (whichever the
    router happened to use); on leaving, every hold is let go."""
    armed = [s.hold(i, point) for i in workers]
    try:

        async def seen() -> int | None:
            return next((i + 1 for i in workers if s.reached(i, point)), None)  # 0 is falsy

        yield int(await wait_for(seen, 20, what)) - 1
    finally:
        for f in armed:
            f.unlink(missing_ok=True)


async def _kill_at(s: Any, workers: tuple[int, ...], point: str, what: str) -> int:
    """The first of ``workers`` to stop at ``point`` is killed there; returns it."""
    async with _held(s, workers, point, what) as i:
        freeze_then_kill(s, i)
    return int(i)
