"""The simulator's role switch: a worker drains what it holds and serves the other role
after the switch time, not after a cold start (times worked out by hand)."""

from __future__ import annotations

import numpy as np
import pytest
from splitserve_operator.sim.config import PoolConfig, Role, SimConfig
from splitserve_operator.sim.cost import MeasuredCost
from splitserve_operator.sim.hardware import LinkSpec
from splitserve_operator.sim.model_spec import ModelSpec
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.workload import Workload

pytestmark = pytest.mark.unit

TOY = ModelSpec("toy", layers=4, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16,
                vocab=10)  # fmt: skip
COST = MeasuredCost(prefill_base_s=0.01, prefill_per_token_s=0.001, decode_base_s=0.02,
                    decode_per_seq_s=0.001)  # fmt: skip
LINK = LinkSpec("toy-link", "1 GB/s", bandwidth=1e9)


def config(prefill: int, decode: int, startup_s: float = 300.0) -> SimConfig:
    pool = PoolConfig(cost=COST, kv_capacity_tokens=100_000, max_seqs=64)
    return SimConfig(model=TOY, pools={Role.PREFILL: pool, Role.DECODE: pool},
                     replicas={Role.PREFILL: prefill, Role.DECODE: decode}, link=LINK,
                     layerwise=False, startup_s=startup_s)  # fmt: skip


def prompts(n: int, at: float, tokens: int) -> Workload:
    return Workload(np.full(n, at), np.full(n, tokens, dtype=np.int64),
                    np.full(n, 2, dtype=np.int64), None, block_tokens=512)  # fmt: skip


def test_a_switched_worker_serves_its_new_role_after_the_switch_not_a_cold_start() -> None:
    sim = Simulator(config(1, 2), prompts(4, at=10.0, tokens=990))
    sim.run_until(1.0)
    assert sim.switch(Role.DECODE, Role.PREFILL, switch_s=2.0)
    assert (sim.replicas(Role.PREFILL), sim.replicas(Role.DECODE)) == (2, 1)
    assert sim.gpus() == 3  # the idle decode worker gave its GPU at once
    sim.run()
    # both prefill workers ready by 3 s: the four 990-token prompts (1 s each) arriving at
    # 10 s run two at a time, so the last first token is at 12 s, not 14 s
    firsts = sorted(r.t_first for r in sim.finished)
    assert firsts[-1] == pytest.approx(12.0, abs=0.01)


def test_a_switch_needs_an_active_worker_of_the_role_it_leaves() -> None:
    sim = Simulator(config(1, 1), prompts(1, at=0.0, tokens=10))
    assert sim.switch(Role.DECODE, Role.PREFILL, switch_s=1.0)
    assert not sim.switch(Role.DECODE, Role.PREFILL, switch_s=1.0)  # none left to give
    assert (sim.replicas(Role.PREFILL), sim.replicas(Role.DECODE)) == (2, 0)
