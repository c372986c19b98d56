"""The planner's decisions, one table row per situation, with the arithmetic written out.

Defaults used throughout (``PlannerConfig()``): target_utilization 0.8,
proactive_utilization 0.95, panic_ratio 2, breach_ratio 1, scale_down_ratio 0.8,
max_up_factor 2, queue_wait_budget 0.5, quiet_queue_fraction 0.1,
queue_drain_s 30, kv 0.60 / 0.75 / 0.90, down_stabilization_s 120,
cooldown_after_up_s 300, cooldown_after_down_s 60, observation_window_s 60.
SLO: TTFT 1 s, TPOT 50 ms at p90. ``NOW`` = 1000 s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from splitserve_operator.planner.config import PlannerConfig
from splitserve_operator.planner.core import plan
from splitserve_operator.planner.model import (
    Bounds,
    Direction,
    Observation,
    PlannerState,
    Pool,
    PoolMemory,
    PoolStatus,
    Reason,
    Slo,
    Tick,
)
from splitserve_operator.planner.signals import PoolSignals, decode_signals, prefill_signals

pytestmark = pytest.mark.unit

NOW = 1000.0
SLO = Slo(ttft_s=1.0, tpot_s=0.05, percentile=0.9)
CFG = PlannerConfig()
WIDE = Bounds(1, 10)

# A calm service: 20 req/s of 512-token prompts and 128-token outputs on 2 + 2 replicas.
CALM = dict(
    ttft_s=0.2,
    tpot_s=0.04,
    request_rate=20.0,
    prompt_token_rate=10240.0,
    generation_token_rate=2560.0,
    prefill_queue=0.0,
    decode_queue=0.0,
    kv_utilization=0.5,
)


@dataclass(frozen=True)
class Case:
    id: str
    pool: Pool
    obs: dict[str, float | None]
    want: int
    reason: Reason
    replicas: int = 2
    ready: int | None = None
    bounds: Bounds = WIDE
    memory: PoolMemory = field(default_factory=PoolMemory)
    ratio: float | None = None
    """Learned generated tokens per prompt token (decode demand)."""


CASES = [
    Case(
        "tpot-breach-unknown-capacity-reactive-step",
        Pool.DECODE,
        # TPOT 0.075 / 0.05 = 1.5x; no capacity yet: ceil(2 x min(1.5, 2)) = 3 (>= ready + 1 = 3)
        {"tpot_s": 0.075},
        want=3,
        reason=Reason.SLO_BREACH,
    ),
    Case(
        "tpot-breach-step-capped-at-max-up-factor",
        Pool.DECODE,
        # 0.15 / 0.05 = 3x, capped: ceil(2 x min(3, 2)) = 4
        {"tpot_s": 0.15},
        want=4,
        reason=Reason.SLO_BREACH,
    ),
    Case(
        "tpot-breach-trusted-capacity-sizes-from-arrivals",
        Pool.DECODE,
        # demand = 12000 prompt tok/s x 0.25 = 3000 tok/s; ceil(3000 / (1000 x 0.8)) = 4
        {"tpot_s": 0.06, "prompt_token_rate": 12000.0, "generation_token_rate": 2000.0},
        want=4,
        reason=Reason.SLO_BREACH,
        memory=PoolMemory(capacity=1000.0, capacity_trusted=True),
        ratio=0.25,
    ),
    Case(
        "long-prefill-queue-with-low-ttft-still-scales-up",
        Pool.PREFILL,
        # TTFT 0.2 s is fine, but 40 queued at 20 req/s wait 40 / 20 = 2 s > 0.5 x 1 s;
        # ceil(2 x min(2 / 0.5, 2)) = 4
        {"ttft_s": 0.2, "prefill_queue": 40.0},
        want=4,
        reason=Reason.QUEUE,
    ),
    Case(
        "queue-with-trusted-capacity-sizes-for-the-backlog",
        Pool.PREFILL,
        # mean prompt 10240 / 20 = 512; backlog 300 x 512 / 30 s = 5120 tok/s;
        # ceil((10240 + 5120) / (8000 x 0.8)) = ceil(2.4) = 3
        {"prefill_queue": 300.0},
        want=3,
        reason=Reason.QUEUE,
        memory=PoolMemory(capacity=8000.0, capacity_trusted=True),
    ),
    Case(
        "queue-step-multiplies-the-ready-replicas",
        Pool.PREFILL,
        # 80 queued at 20 req/s wait 4 s: ceil(4 x min(4 / 0.5, 2)) = 8 (the lower bound
        # 10240 / 4 = 2560 per replica sizes only ceil(10240 / 2560) = 4)
        {"prefill_queue": 80.0},
        replicas=4,
        want=8,
        reason=Reason.QUEUE,
    ),
    Case(
        "queue-wait-at-the-budget-is-no-pressure",
        Pool.PREFILL,
        # 10 queued at 20 req/s wait 0.5 s = 0.5 x 1 s: not above the budget; not quiet
        # either, so no shrink
        {"prefill_queue": 10.0},
        want=2,
        reason=Reason.WITHIN_SLO,
    ),
    Case(
        "queue-backlog-on-a-lower-bound-is-not-counted-twice",
        Pool.PREFILL,
        # saturated (100 queued wait 5 s), so the lower bound 2048 stays: without the
        # backlog ceil(10240 / 2048) = 5; the reactive step ceil(2 x 2) = 4 is smaller
        {"prefill_queue": 100.0},
        want=5,
        reason=Reason.QUEUE,
        memory=PoolMemory(capacity=2048.0),
    ),
    Case(
        "queue-without-a-request-rate-adds-no-backlog",
        Pool.PREFILL,
        # no request rate: the queue's wait is unbounded, but its mean prompt is unknown
        # (0 tokens): ceil(12800 / (8000 x 0.8)) = 2, no more than the pool has
        {"prompt_token_rate": 12800.0, "request_rate": 0.0, "prefill_queue": 30.0},
        want=2,
        reason=Reason.QUEUE,
        memory=PoolMemory(capacity=8000.0, capacity_trusted=True),
    ),
    Case(
        "decode-queue-backlog-uses-the-mean-output",
        Pool.DECODE,
        # 15 queued at 20 req/s wait 0.75 s > 0.5 s; mean output 2560 / 20 = 128, backlog
        # 15 x 128 / 30 = 64 tok/s: ceil((2560 + 64) / (1000 x 0.8)) = ceil(3.28) = 4
        {"decode_queue": 15.0},
        want=4,
        reason=Reason.QUEUE,
        memory=PoolMemory(capacity=1000.0, capacity_trusted=True),
    ),
    Case(
        "kv-step-above-the-breach-step-wins",
        Pool.DECODE,
        # TPOT 1.1x: ceil(4 x 1.1) = 5; KV 96 %: ceil(4 x 0.96 / 0.75) = 6: the larger
        # target's reason is reported
        {"tpot_s": 0.055, "kv_utilization": 0.96},
        replicas=4,
        want=6,
        reason=Reason.KV_PRESSURE,
    ),
    Case(
        "backlog-gone-a-whole-window-ago-latency-counts",
        Pool.PREFILL,
        # the backlog ended 60 s ago (not < 60): TTFT 1.5x is trusted, ceil(2 x 1.5) = 3
        {"ttft_s": 1.5},
        want=3,
        reason=Reason.SLO_BREACH,
        memory=PoolMemory(backlog_at=NOW - 60),
    ),
    Case(
        "backlog-gone-long-ago-latency-counts",
        Pool.PREFILL,
        {"ttft_s": 1.5},
        want=3,
        reason=Reason.SLO_BREACH,
        memory=PoolMemory(backlog_at=NOW - 100),
    ),
    Case(
        "missing-series-below-a-raised-minimum",
        Pool.PREFILL,
        # no data, but the bounds are the spec's: 1 -> 2
        {"prompt_token_rate": None},
        replicas=1,
        bounds=Bounds(2, 5),
        want=2,
        reason=Reason.BOUNDS,
    ),
    Case(
        "missing-series-above-a-lowered-maximum",
        Pool.PREFILL,
        {"prompt_token_rate": None},
        replicas=7,
        bounds=Bounds(1, 5),
        want=5,
        reason=Reason.BOUNDS,
    ),
    Case(
        "kv-pressure",
        Pool.DECODE,
        # KV 96 % >= 90 %: ceil(4 x 0.96 / 0.75) = ceil(5.12) = 6
        {"kv_utilization": 0.96},
        replicas=4,
        want=6,
        reason=Reason.KV_PRESSURE,
    ),
    Case(
        "capped-by-max-replicas",
        Pool.DECODE,
        # wants ceil(4 x 0.96 / 0.75) = 6, max is 5
        {"kv_utilization": 0.96},
        replicas=4,
        bounds=Bounds(1, 5),
        want=5,
        reason=Reason.KV_PRESSURE,
    ),
    Case(
        "at-max-already",
        Pool.DECODE,
        {"kv_utilization": 0.96},
        replicas=5,
        bounds=Bounds(1, 5),
        want=5,
        reason=Reason.AT_MAX,
    ),
    Case(
        "kv-pressure-while-starting-at-max-holds-on-kv",
        Pool.DECODE,
        # not settled (ready 10 s ago, window 60 s): KV asks for the 5 there are, which
        # is max but not over it: a hold on KV pressure, not at max
        {"kv_utilization": 0.96},
        replicas=5,
        bounds=Bounds(1, 5),
        memory=PoolMemory(settled_at=NOW - 10),
        want=5,
        reason=Reason.KV_PRESSURE,
    ),
    Case(
        "kv-pressure-while-starting-below-max-holds-on-kv",
        Pool.DECODE,
        {"kv_utilization": 0.96},
        replicas=3,
        bounds=Bounds(1, 5),
        memory=PoolMemory(settled_at=NOW - 10),
        want=3,
        reason=Reason.KV_PRESSURE,
    ),
    Case(
        "replicas-starting-no-second-step",
        Pool.DECODE,
        # 4 asked, 2 ready: the breach is what the 2 starting ones will fix
        {"tpot_s": 0.1},
        replicas=4,
        ready=2,
        want=4,
        reason=Reason.PENDING,
    ),
    Case(
        "panic-arrivals-twice-the-lower-bound",
        Pool.DECODE,
        # demand 20000 x 0.25 = 5000 tok/s is 5000 / (1000 x 2) = 2.5x what 2 replicas were
        # seen to serve (> 2): ceil(5000 / (1000 x 1)) = 5 (a lower bound is used as it is;
        # serving 1600 / 2 = 800 per replica now does not raise it); TPOT 0.9x is stress
        {"prompt_token_rate_fast": 20000.0, "generation_token_rate": 1600.0, "tpot_s": 0.045},
        want=5,
        reason=Reason.DEMAND,
        memory=PoolMemory(capacity=1000.0),
        ratio=0.25,
    ),
    Case(
        "proactive-with-trusted-capacity-before-the-slo-breaks",
        Pool.PREFILL,
        # 16000 / (8000 x 2) = 1.0 > 0.95: ceil(16000 / (8000 x 0.8)) = ceil(2.5) = 3
        {"prompt_token_rate_fast": 16000.0},
        want=3,
        reason=Reason.DEMAND,
        memory=PoolMemory(capacity=8000.0, capacity_trusted=True),
    ),
    Case(
        "hysteresis-band-holds",
        Pool.DECODE,
        # TPOT 0.045 / 0.05 = 0.9: neither above 1 (up) nor below 0.8 (down)
        {"tpot_s": 0.045},
        replicas=4,
        want=4,
        reason=Reason.WITHIN_SLO,
    ),
    Case(
        "draining-a-backlog-no-reactive-step",
        Pool.PREFILL,
        # served 40000 > 30000 x 1.1: the TTFT breach is requests that already waited
        {
            "ttft_s": 3.0,
            "prompt_token_rate": 30000.0,
            "prefill_served_token_rate": 40000.0,
            "request_rate": 60.0,
        },
        replicas=6,
        want=6,
        reason=Reason.SLO_BREACH,
    ),
    Case(
        "echo-of-a-backlog-gone-20s-ago",
        Pool.PREFILL,
        # queue gone, but a backlog 20 s ago (< the 60 s window) still shows in TTFT
        {"ttft_s": 1.5},
        want=2,
        reason=Reason.SLO_BREACH,
        memory=PoolMemory(backlog_at=NOW - 20),
    ),
    Case(
        "surplus-stabilizing",
        Pool.PREFILL,
        # ceil(10240 / (8000 x 0.8)) = ceil(1.6) = 2 < 6, first tick of the wish: wait 120 s
        {},
        replicas=6,
        want=6,
        reason=Reason.STABILIZING,
        memory=PoolMemory(capacity=8000.0, capacity_trusted=True),
    ),
    Case(
        "surplus-shrinks-to-the-largest-proposal-of-the-window",
        Pool.PREFILL,
        # wanted since 150 s (>= 120); proposals 3 (100 s ago) and ceil(10240 / 6400) = 2 now
        {},
        replicas=6,
        want=3,
        reason=Reason.SURPLUS,
        memory=PoolMemory(
            capacity=8000.0,
            capacity_trusted=True,
            shrink_since=NOW - 150,
            shrink_proposals=((NOW - 100, 3),),
        ),
    ),
    Case(
        "after-a-drop-a-shrink-sizes-for-the-fast-window",
        Pool.PREFILL,
        # the 60 s window still says 30000 tok/s, the fast one 10000:
        # ceil(10000 / (8000 x 0.8)) = ceil(1.56) = 2 (a scale-up would size for 30000)
        {"prompt_token_rate": 30000.0, "prompt_token_rate_fast": 10000.0},
        replicas=6,
        want=2,
        reason=Reason.SURPLUS,
        memory=PoolMemory(capacity=8000.0, capacity_trusted=True, shrink_since=NOW - 150),
    ),
    Case(
        "surplus-in-cooldown-after-up",
        Pool.PREFILL,
        # wanted long enough, but the last scale-up was 100 s ago (< 300)
        {},
        replicas=6,
        want=6,
        reason=Reason.COOLDOWN,
        memory=PoolMemory(
            capacity=8000.0,
            capacity_trusted=True,
            shrink_since=NOW - 150,
            last_up_at=NOW - 100,
        ),
    ),
    Case(
        "surplus-shrinks-once-the-cooldown-after-up-has-passed",
        Pool.PREFILL,
        # the last scale-up was 300 s ago (not < 300): ceil(10240 / 6400) = 2
        {},
        replicas=6,
        want=2,
        reason=Reason.SURPLUS,
        memory=PoolMemory(
            capacity=8000.0,
            capacity_trusted=True,
            shrink_since=NOW - 400,
            last_up_at=NOW - 300,
        ),
    ),
    Case(
        "surplus-in-cooldown-after-up-one-second-before-it-ends",
        Pool.PREFILL,
        # the last scale-up was 299 s ago (< 300)
        {},
        replicas=6,
        want=6,
        reason=Reason.COOLDOWN,
        memory=PoolMemory(
            capacity=8000.0,
            capacity_trusted=True,
            shrink_since=NOW - 400,
            last_up_at=NOW - 299,
        ),
    ),
    Case(
        "surplus-in-cooldown-after-down",
        Pool.PREFILL,
        # wanted for 150 s (>= 120), no scale-up ever, but the last scale-down was
        # 30 s ago (< 60): the 6 -> 2 shrink waits
        {},
        replicas=6,
        want=6,
        reason=Reason.COOLDOWN,
        memory=PoolMemory(
            capacity=8000.0,
            capacity_trusted=True,
            shrink_since=NOW - 150,
            last_down_at=NOW - 30,
        ),
    ),
    Case(
        "surplus-in-cooldown-after-down-one-second-before-it-ends",
        Pool.PREFILL,
        # the last scale-down was 59 s ago (< 60): any shorter cooldown would shrink here
        {},
        replicas=6,
        want=6,
        reason=Reason.COOLDOWN,
        memory=PoolMemory(
            capacity=8000.0,
            capacity_trusted=True,
            shrink_since=NOW - 150,
            last_down_at=NOW - 59,
        ),
    ),
    Case(
        "surplus-shrinks-once-the-cooldown-after-down-has-passed",
        Pool.PREFILL,
        # the last scale-down was 60 s ago (not < 60): ceil(10240 / 6400) = 2
        {},
        replicas=6,
        want=2,
        reason=Reason.SURPLUS,
        memory=PoolMemory(
            capacity=8000.0,
            capacity_trusted=True,
            shrink_since=NOW - 150,
            last_down_at=NOW - 60,
        ),
    ),
    Case(
        "surplus-lower-bound-capacity-has-no-headroom-factor",
        Pool.PREFILL,
        # untrusted 5120 tok/s per replica: ceil(10240 / (5120 x 1)) = 2
        {},
        replicas=4,
        want=2,
        reason=Reason.SURPLUS,
        memory=PoolMemory(capacity=5120.0, shrink_since=NOW - 130),
    ),
    Case(
        "surplus-wanted-119s-still-stabilizing",
        Pool.PREFILL,
        # ceil(10240 / 6400) = 2 < 6, wanted for 119 s (< 120)
        {},
        replicas=6,
        want=6,
        reason=Reason.STABILIZING,
        memory=PoolMemory(capacity=8000.0, capacity_trusted=True, shrink_since=NOW - 119),
    ),
    Case(
        "surplus-wanted-120s-shrinks",
        Pool.PREFILL,
        # wanted for 120 s (not < 120): 6 -> 2
        {},
        replicas=6,
        want=2,
        reason=Reason.SURPLUS,
        memory=PoolMemory(capacity=8000.0, capacity_trusted=True, shrink_since=NOW - 120),
    ),
    Case(
        "surplus-capacity-unknown-one-fewer",
        Pool.PREFILL,
        # 2 prompt tok/s over 4 replicas is 0.5 per replica (< 1: nothing learned), TTFT
        # 0.2x: no capacity to size from, so one fewer: 4 - 1 = 3
        {"prompt_token_rate": 2.0, "request_rate": 0.01},
        replicas=4,
        want=3,
        reason=Reason.SURPLUS,
        memory=PoolMemory(shrink_since=NOW - 150),
    ),
    Case(
        "decode-surplus-on-low-tpot",
        Pool.DECODE,
        # TPOT 0.02 / 0.05 = 0.4 < 0.8, KV 50 % < 60 %: ceil(2560 / (1000 x 0.8)) = 4 < 6
        {"tpot_s": 0.02},
        replicas=6,
        want=4,
        reason=Reason.SURPLUS,
        memory=PoolMemory(capacity=1000.0, capacity_trusted=True, shrink_since=NOW - 150),
    ),
    Case(
        "decode-trickle-is-not-idle",
        Pool.DECODE,
        # 0.5 generated tok/s and no arrivals is not idle (tokens still flow): 0.5 / 5
        # replicas teaches no capacity, so one fewer, 5 -> 4, not the minimum 2
        {
            "prompt_token_rate": 0.0,
            "generation_token_rate": 0.5,
            "request_rate": 0.0,
            "tpot_s": None,
            "ttft_s": None,
            "kv_utilization": 0.0,
        },
        replicas=5,
        bounds=Bounds(2, 10),
        want=4,
        reason=Reason.SURPLUS,
        memory=PoolMemory(shrink_since=NOW - 150),
    ),
    Case(
        "latency-fine-but-capacity-wants-more-is-no-shrink",
        Pool.PREFILL,
        # load 10240 / (6000 x 2) = 0.85 (< 0.95: no proactive step), TTFT 0.2x: a shrink
        # would size ceil(10240 / (6000 x 0.8)) = 3 > 2, which is no shrink at all
        {},
        want=2,
        reason=Reason.WITHIN_SLO,
        memory=PoolMemory(capacity=6000.0, capacity_trusted=True),
    ),
    Case(
        "idle-goes-to-the-minimum",
        Pool.DECODE,
        {
            "prompt_token_rate": 0.0,
            "generation_token_rate": 0.0,
            "request_rate": 0.0,
            "tpot_s": None,
            "ttft_s": None,
            "kv_utilization": 0.0,
        },
        replicas=5,
        bounds=Bounds(2, 10),
        want=2,
        reason=Reason.IDLE,
        memory=PoolMemory(shrink_since=NOW - 120),
    ),
    Case(
        "outside-new-bounds-is-brought-inside",
        Pool.PREFILL,
        {"ttft_s": 0.8},  # 0.8x: inside the band, no other wish
        replicas=12,
        want=8,
        bounds=Bounds(1, 8),
        reason=Reason.BOUNDS,
    ),
    Case(
        "below-a-raised-minimum-is-brought-inside",
        Pool.PREFILL,
        {"ttft_s": 0.8},  # 0.8x: inside the band, no other wish
        replicas=1,
        want=3,
        bounds=Bounds(3, 8),
        reason=Reason.BOUNDS,
    ),
    Case(
        "missing-series-holds",
        Pool.PREFILL,
        {"prompt_token_rate": None, "prefill_queue": 500.0},
        want=2,
        reason=Reason.MISSING_DATA,
    ),
]


def _tick(case: Case) -> tuple[PlannerState, Tick]:
    obs = Observation(**{**CALM, **case.obs})  # type: ignore[arg-type]
    target = PoolStatus(
        case.replicas, case.ready if case.ready is not None else case.replicas, case.bounds
    )
    other = PoolStatus(2, 2, WIDE)
    memory = {Pool.PREFILL: PoolMemory(), Pool.DECODE: PoolMemory()}
    memory[case.pool] = case.memory
    state = PlannerState(
        prefill=memory[Pool.PREFILL], decode=memory[Pool.DECODE], output_per_prompt_token=case.ratio
    )
    tick = Tick(
        now=NOW,
        slo=SLO,
        prefill=target if case.pool is Pool.PREFILL else other,
        decode=target if case.pool is Pool.DECODE else other,
        observation=obs,
    )
    return state, tick


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decision(case: Case) -> None:
    state, tick = _tick(case)
    result = plan(state, tick, CFG)
    decision = result.prefill if case.pool is Pool.PREFILL else result.decode
    assert (decision.replicas, decision.reason) == (case.want, case.reason), decision.detail
    expected_direction = (
        Direction.UP
        if case.want > case.replicas
        else Direction.DOWN
        if case.want < case.replicas
        else Direction.HOLD
    )
    assert decision.direction is expected_direction
    assert decision.detail


def test_unreachable_metrics_hold_both_pools_and_break_a_shrink_window() -> None:
    state = PlannerState(prefill=PoolMemory(shrink_since=NOW - 100, shrink_proposals=((1, 1),)))
    tick = Tick(NOW, SLO, PoolStatus(3, 3, WIDE), PoolStatus(4, 4, WIDE), observation=None)
    result = plan(state, tick, CFG)
    assert not result.metrics_ok
    for d in result.decisions():
        assert (d.direction, d.reason) == (Direction.HOLD, Reason.MISSING_DATA)
    assert (result.prefill.replicas, result.decode.replicas) == (3, 4)
    # the shrink wish must be wanted again, without a break, from scratch
    assert result.state.prefill.shrink_since is None
    assert result.state.prefill.shrink_proposals == ()


def test_the_reason_for_equal_targets_is_the_slo_first() -> None:
    # TPOT 1.5x -> ceil(2 x 1.5) = 3; KV 0.95 -> ceil(2 x 0.95 / 0.75) = ceil(2.53) = 3
    case = Case("tie", Pool.DECODE, {"tpot_s": 0.075, "kv_utilization": 0.95}, 3, Reason.SLO_BREACH)
    state, tick = _tick(case)
    assert plan(state, tick, CFG).decode.reason is Reason.SLO_BREACH


def test_plan_is_pure() -> None:
    case = CASES[0]
    state, tick = _tick(case)
    assert plan(state, tick, CFG) == plan(state, tick, CFG)


def test_a_shrink_starts_the_cooldown_after_down() -> None:
    # Tick 1 shrinks 6 -> 3 (the largest proposal of the window); 30 s later the same
    # surplus (ceil(10240 / 6400) = 2 < 3) must wait for the 60 s cooldown after that
    # shrink, and at 60 s it may shrink again.
    memory = PoolMemory(
        capacity=8000.0,
        capacity_trusted=True,
        shrink_since=NOW - 150,
        shrink_proposals=((NOW - 100, 3),),
    )
    state = PlannerState(prefill=memory)
    obs = Observation(**CALM)  # type: ignore[arg-type]
    other = PoolStatus(2, 2, WIDE)
    first = plan(state, Tick(NOW, SLO, PoolStatus(6, 6, WIDE), other, obs), CFG)
    assert (first.prefill.replicas, first.prefill.reason) == (3, Reason.SURPLUS)
    assert first.state.prefill.last_down_at == NOW
    held = plan(first.state, Tick(NOW + 30, SLO, PoolStatus(3, 3, WIDE), other, obs), CFG)
    assert (held.prefill.replicas, held.prefill.reason) == (3, Reason.COOLDOWN), held.prefill.detail
    again = plan(held.state, Tick(NOW + 60, SLO, PoolStatus(3, 3, WIDE), other, obs), CFG)
    assert (again.prefill.replicas, again.prefill.reason) == (2, Reason.SURPLUS), (
        again.prefill.detail
    )


@pytest.mark.parametrize(("queued", "prefill_backlog", "decode_backlog"), [
    (60.0, 60 * 512 / 30, 60 * 128 / 30),  # 60 requests of 512 prompt and 128 output tokens
    (0.0, 0.0, 0.0),
])  # fmt: skip
def test_a_queue_is_a_backlog_of_its_tokens_to_drain_within_queue_drain_s(
    queued: float, prefill_backlog: float, decode_backlog: float
) -> None:
    # 20 req/s, 10240 prompt and 2560 generated tokens/s: 512 and 128 tokens a request
    obs = Observation(**{**CALM, "prefill_queue": queued, "decode_queue": queued})  # type: ignore[arg-type]
    prefill, decode = prefill_signals(obs, SLO, CFG), decode_signals(obs, SLO, CFG, None)
    assert isinstance(prefill, PoolSignals) and isinstance(decode, PoolSignals)
    assert prefill.backlog_rate == pytest.approx(prefill_backlog)
    assert decode.backlog_rate == pytest.approx(decode_backlog)
