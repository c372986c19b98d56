"""The local rebalancer: the router's own TTFT/TPOT windows and queues in, one switch
out, through the same policy as the operator's planner (clock and workers injected)."""

from __future__ import annotations

import pytest
from splitserve import metric_names as names
from splitserve.metric_registry import Metrics
from splitserve.role_balance import BalanceConfig, Reason
from splitserve.roles import Role
from splitserve_worker.router.rebalancer import FlexSettings, Rebalancer, window_quantile
from splitserve_worker.router.scoring import WorkerView

pytestmark = pytest.mark.unit

SETTINGS = FlexSettings(ttft_slo_s=1.0, tpot_slo_s=0.05,
                        balance=BalanceConfig(min_dwell_s=10.0, sustain_s=2.0))  # fmt: skip


def test_the_window_quantile_reads_only_what_came_since_the_last_reading() -> None:
    before = [(0.1, 100.0), (1.0, 100.0), (float("inf"), 100.0)]
    now = [(0.1, 100.0), (1.0, 104.0), (float("inf"), 110.0)]
    # 10 new: 4 in (0.1, 1], 6 above 1 -> the 0.9 quantile is in the +Inf bucket: 1.0
    assert window_quantile(now, before, 0.9) == 1.0
    # the median (rank 5) is past the 4 in (0.1, 1]: also 1.0; the 0.3 quantile (rank 3)
    # is 3/4 of the way through (0.1, 1]
    assert window_quantile(now, before, 0.3) == pytest.approx(0.1 + 0.9 * 3 / 4)
    assert window_quantile(before, before, 0.9) is None


class Workers:
    def __init__(self) -> None:
        self.views = {
            "a": WorkerView(name="a", role=Role.PREFILL, free_blocks=90, total_blocks=100),
            "b": WorkerView(name="b", role=Role.DECODE, free_blocks=90, total_blocks=100),
            "c": WorkerView(
                name="c", role=Role.DECODE, free_blocks=80, total_blocks=100, running=3
            ),
        }
        self.marked: list[str] = []
        self.asked: list[tuple[str, Role]] = []

    def snapshot(self) -> list[WorkerView]:
        return list(self.views.values())

    def mark(self, name: str) -> None:
        self.marked.append(name)

    async def switch(self, name: str, role: Role) -> None:
        self.asked.append((name, role))
        v = self.views[name]
        self.views[name] = WorkerView(name=name, role=role, total_blocks=v.total_blocks,
                                      free_blocks=v.total_blocks)  # fmt: skip


async def test_slow_first_tokens_move_the_idler_decode_worker_to_prefill_once_per_dwell() -> None:
    m = Metrics()
    ttft, tpot = m.histogram(names.TTFT), m.histogram(names.TPOT)
    workers, now = Workers(), [100.0]
    r = Rebalancer(m.registry, workers.snapshot, workers.mark, workers.switch, {"a", "b", "c"},
                   SETTINGS, clock=lambda: now[0])  # fmt: skip
    reasons = []
    for _ in range(6):  # a tick a second, each window with TTFTs of 3 s and TPOTs of 10 ms
        for _ in range(20):
            ttft.observe(3.0)
            tpot.observe(0.01)
        reasons.append(r.tick().reason)
        await r.close()  # the switch it asked for, if any, is over
        now[0] += 1.0
    await r.close()
    # pressure seen at 100, sustained 2 s at 102: b (idler than c) goes to prefill; then
    # prefill is still slow, sustained again by 105, but the last switch was 3 s ago
    assert reasons == [Reason.SUSTAIN, Reason.SUSTAIN, Reason.SWITCH,
                       Reason.SUSTAIN, Reason.SUSTAIN, Reason.DWELL]  # fmt: skip
    assert workers.marked == ["b"] and workers.asked == [("b", Role.PREFILL)]
    assert r.switches == [(102.0, "b", Role.PREFILL)]


async def test_a_quiet_window_switches_nothing() -> None:
    m = Metrics()
    m.histogram(names.TTFT)
    m.histogram(names.TPOT)
    workers = Workers()
    r = Rebalancer(m.registry, workers.snapshot, workers.mark, workers.switch, {"a", "b", "c"},
                   SETTINGS, clock=lambda: 0.0)  # fmt: skip
    assert r.tick().reason is Reason.BALANCED
    m.gauge(names.PREFILL_QUEUE).set(3)  # a prefill queue is pressure even with no TTFT yet
    assert r.tick().reason is Reason.SUSTAIN
    assert workers.asked == []
