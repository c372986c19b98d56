"""The bounded queues: admission, FIFO order, refusal when full, timeouts."""

from __future__ import annotations

import asyncio

import pytest
from splitserve_worker.router.queues import Saturated, Stage

pytestmark = pytest.mark.unit


async def settle() -> None:
    """Let woken tasks run (each wake-up takes a few loop turns)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_admits_up_to_capacity_then_queues_then_refuses() -> None:
    depths: list[int] = []
    st = Stage("prefill", capacity=2, max_waiting=1, max_wait_s=5, on_depth=depths.append)
    await st.acquire()
    await st.acquire()
    assert st.active == 2 and st.waiting == 0
    third = asyncio.create_task(st.acquire())
    await asyncio.sleep(0)
    assert st.waiting == 1
    with pytest.raises(Saturated) as info:
        await st.acquire()
    assert info.value.status == 429 and info.value.retry_after_s == 1
    assert "full" in str(info.value)
    st.release()
    await asyncio.wait_for(third, 1)
    assert st.active == 2 and st.waiting == 0
    assert depths[-1] == 0 and max(depths) == 1


async def test_waiting_past_max_wait_is_refused_with_503_and_leaves_queue() -> None:
    st = Stage("decode", capacity=0, max_waiting=4, max_wait_s=0.05, retry_after_s=3)
    with pytest.raises(Saturated) as info:
        await st.acquire()
    assert info.value.status == 503 and info.value.retry_after_s == 3
    assert st.waiting == 0 and st.active == 0


async def test_fifo_order_and_capacity_growth() -> None:
    st = Stage("prefill", capacity=0, max_waiting=10, max_wait_s=5)
    order: list[int] = []

    async def one(i: int) -> None:
        await st.acquire()
        order.append(i)

    tasks = [asyncio.create_task(one(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert st.waiting == 3
    st.set_capacity(2)
    await settle()
    assert order == [0, 1] and st.waiting == 1
    st.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]


async def test_cancelled_waiter_leaves_no_trace() -> None:
    st = Stage("prefill", capacity=1, max_waiting=10, max_wait_s=5)
    async with st.slot():
        t = asyncio.create_task(st.acquire())
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert st.waiting == 0
    assert st.active == 0
