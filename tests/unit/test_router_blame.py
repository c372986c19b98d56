"""Whose fault a failed attempt is, and what the router does about it: a request's own
fault never takes a worker out of the pool, a worker is excluded by identity (one
restarted at its address is another worker), and a request no worker can ever take
fails at once, saying why (in-memory workers: ``tests/support/mem_workers.py``)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from mem_workers import MemWorker, expected, make, run
from splitserve.sampling import SamplingParams
from splitserve_worker.router.config import QueueConfig
from splitserve_worker.router.failures import RequestFailed

pytestmark = pytest.mark.unit

GUARD_S = 30.0
"""A hang guard only: every scenario here ends well before it, or is a bug."""


@pytest.mark.parametrize("where", ["local", "remote"])
async def test_a_request_the_wire_cannot_carry_is_its_own_400_and_marks_no_worker(
    where: str,
) -> None:
    """A lone surrogate in a stop string (which protobuf cannot encode) used to be taken
    for a lost worker: it was marked unhealthy, its prefix index dropped, and the request
    waited for another until a misleading 503."""
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    disp = await make([p1, d1], disaggregation="always" if where == "remote" else "never",
                      queues=QueueConfig(max_wait_s=2))  # fmt: skip
    disp.planner.index.stored("d1", [11, 12])
    bad = SamplingParams(max_tokens=4, stop=("\ud800",))
    with pytest.raises(RequestFailed) as info:
        await asyncio.wait_for(run(disp, [1, 2, 3], 4, bad), GUARD_S)
    assert info.value.status == 400 and "cannot be sent to a worker" in info.value.message
    assert all(v.healthy for v in disp.pool.snapshot())
    assert disp.planner.index.match([11, 12]) == {"d1": 2}, "the worker's prefix index went"
    assert disp.decode_stage.active == 0 and disp.prefill_stage.active == 0
    # and the same workers serve the next request
    assert await run(disp, [1, 2, 3], 4) == expected([1, 2, 3], 4)


async def test_a_worker_restarted_at_its_address_takes_the_requests_that_saw_it_fail() -> None:
    """The only decode worker dies mid-stream and is back at the same address as a new
    process: the request that saw it fail moves to it (it used to exclude the address
    and wait out max_wait_s)."""
    b1 = MemWorker("b1", "both")
    disp = await make([b1], health_interval_s=0.02, queues=QueueConfig(max_wait_s=5))
    first = b1.instance
    b1.fail_generate_after = 3
    b1.restart_after_failing = True
    out = await asyncio.wait_for(run(disp, [7, 8, 9], 10), GUARD_S)
    assert out == expected([7, 8, 9], 10)
    assert b1.instance != first and [g[0] for g in b1.generated] == ["r.0", "r.1"]
    _, prompt, max_tokens = b1.generated[1]
    assert prompt == (7, 8, 9, *expected([7, 8, 9], 3)) and max_tokens == 7


async def test_a_failure_seen_on_a_worker_that_has_restarted_does_not_mark_the_new_one() -> None:
    b1 = MemWorker("b1", "both")
    disp = await make([b1])
    old = disp.pool.snapshot()[0].instance
    b1.restart()
    await disp.pool.refresh(disp.pool._members["b1"])
    disp.pool.mark_failed("b1", "test: seen on the old process", old)
    view = disp.pool.snapshot()[0]
    assert view.healthy and view.instance == b1.instance


async def test_a_request_with_nowhere_to_go_fails_at_once_saying_why() -> None:
    """The one decode worker refused the attempt without being lost (it stays healthy,
    the same worker): no other can take it, so the request fails now, not after
    max_wait_s (600 s here)."""
    b1 = MemWorker("b1", "both")
    b1.fail_generate_after = 0
    b1.fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    disp = await make([b1], queues=QueueConfig(max_wait_s=600))
    with pytest.raises(RequestFailed) as info:
        await asyncio.wait_for(run(disp, [1, 2], 4), GUARD_S)
    assert info.value.status == 502
    assert "no decode worker can take this request: b1 already failed it" in info.value.message
    assert "RESOURCE_EXHAUSTED" in info.value.message and disp.pool.snapshot()[0].healthy


async def test_a_prompt_larger_than_every_pool_fails_at_once() -> None:
    b1 = MemWorker("b1", "both")
    b1.total_blocks = 2
    disp = await make([b1], queues=QueueConfig(max_wait_s=600))
    with pytest.raises(RequestFailed) as info:
        await asyncio.wait_for(run(disp, list(range(100)), 4), GUARD_S)
    assert info.value.status == 503 and "b1 holds 2 KV blocks, it needs 8" in info.value.message
