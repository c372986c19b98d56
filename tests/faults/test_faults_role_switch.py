"""A worker switches its role ten times in a row, each time under 20 concurrent streams.

Real processes on 127.0.0.1: a prefill worker, a decode worker and a switchable one that
goes decode -> prefill -> decode -> both -> ... while the router serves 20 streams. A
switch away from decoding drains for a short while only, so the streams still on it are
migrated. Every request must complete with the greedy tokens of a colocated engine, the
router must have moved requests off the switching worker (never counting it a failure),
and after each round every worker is back to its starting free-block count with no
lease, running or waiting request left.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from splitserve.roles import Role
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient

pytestmark = [pytest.mark.slow, pytest.mark.integration]

N = 20
MAX_TOKENS = 160
BOUND_S = 90.0
SWITCHER = 2
ROLES = [Role.PREFILL, Role.DECODE, Role.DECODE]
P, D, B = pb.ROLE_PREFILL, pb.ROLE_DECODE, pb.ROLE_BOTH
SEQUENCE = [P, D, B, P, B, D, P, D, P, D]
"""The switcher's roles, one switch each: every pair of roles, both ways."""
DRAIN_S = 0.2
"""A short drain: streams still on a worker that stops decoding are migrated."""


async def busy(stack: Any, run: asyncio.Task[Any]) -> None:
    """Returns once some streams are under way on the decoding workers."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        hs = [await stack.health(i) for i in range(len(ROLES))]
        if sum(h.running for h in hs if h.role != pb.ROLE_PREFILL) >= 2:
            return
        if run.done():
            raise AssertionError("the requests ended before any stream was seen running")
        await asyncio.sleep(0.01)
    raise AssertionError("no stream ever ran")


def test_ten_role_switches_under_twenty_streams(
    stack_factory: Any, tiny_model_path: Path, kit: Any
) -> None:
    stack = stack_factory(tiny_model_path, ROLES, worker_args=["--switchable"])
    prompts = [kit.prompt_of(7000 + i, n=40) for i in range(N)]
    want = kit.reference_tokens(tiny_model_path, prompts, MAX_TOKENS)
    asyncio.run(switch_ten_times(stack, kit, prompts, want))


async def switch_ten_times(
    stack: Any, kit: Any, prompts: list[list[int]], want: list[list[int]]
) -> None:
    baseline = await stack.baseline()
    migrated = 0
    async with WorkerClient(stack.address(SWITCHER), stack.token, timeout=BOUND_S) as sw:
        for n, role in enumerate(SEQUENCE):
            run = asyncio.create_task(kit.many_requests(stack, prompts, MAX_TOKENS, BOUND_S))
            await busy(stack, run)
            done = await sw.switch_role(role, drain_seconds=DRAIN_S)
            assert done.role == role, f"switch {n}: serves {done.role}, asked {role}"
            migrated += done.migrated
            outcomes = await run
            bad = [o for o in outcomes if not o.completed]
            assert not bad, f"switch {n} to {pb.Role.Name(role)}: {kit.describe(outcomes)}"
            wrong = [o.index for o in outcomes if o.tokens != want[o.index]]
            assert not wrong, f"switch {n}: requests {wrong} got other tokens than greedy"
            h = await stack.health(SWITCHER)
            assert (h.role, h.switching, h.switches) == (role, False, n + 1)
            settled = await stack.wait_settled(baseline)
            leaks = {
                i: (h.free_blocks, h.leases, h.running, h.waiting)
                for i, h in settled.items()
                if (h.free_blocks, h.leases, h.running, h.waiting) != (baseline[i], 0, 0, 0)
            }
            assert not leaks, (
                f"after switch {n}, workers hold (free, leases, running, waiting) {leaks}; "
                f"they started with {baseline} free"
            )
    moves = await kit.router_metric(stack, "splitserve_router_retries_total")
    assert moves.get('{reason="role_switch"}', 0) > 0, moves  # requests were moved, not failed
    assert migrated > 0, "no stream was ever migrated off a switching worker"
    failures = {k: v for k, v in moves.items() if "role_switch" not in k and v}
    why = [line for line in stack.logs() if "failed (" in line][:6]
    assert not failures, f"a switch counted as a worker failure: {failures}: {why}"
