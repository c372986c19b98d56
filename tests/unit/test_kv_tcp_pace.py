"""The tcp KV port's frame pace: a token bucket per peer, pure arithmetic on a clock
the caller passes."""

from __future__ import annotations

import pytest
from splitserve_worker.kv.tcp_server import FrameBudget

pytestmark = pytest.mark.unit


def test_a_burst_is_free_then_each_frame_waits_its_share() -> None:
    b = FrameBudget(rate=10.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.1)
    assert b.take(0.0) == pytest.approx(0.2)


def test_time_refills_the_bucket_up_to_its_burst() -> None:
    b = FrameBudget(rate=10.0, burst=3, now=0.0)
    for _ in range(5):
        b.take(0.0)  # two frames into debt: 0.2 s
    assert b.take(0.3) == 0.0  # the debt paid, and one frame's worth more
    assert b.take(100.0) == 0.0  # a long pause refills to the burst, not beyond
    assert [b.take(100.0) for _ in range(2)] == [0.0, 0.0]
    assert b.take(100.0) == pytest.approx(0.1)
