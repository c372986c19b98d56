"""Goodput search on a system whose capacity is known by hand."""

from __future__ import annotations

import numpy as np
import pytest
from splitserve_operator.sim.config import PoolConfig, Role, SimConfig, Slo
from splitserve_operator.sim.cost import MeasuredCost
from splitserve_operator.sim.goodput import disaggregated_splits, goodput
from splitserve_operator.sim.hardware import get_link
from splitserve_operator.sim.model_spec import ModelSpec
from splitserve_operator.sim.workload import Workload

pytestmark = pytest.mark.unit

TOY = ModelSpec(
    "toy", layers=4, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10
)


def test_goodput_of_a_server_doing_ten_requests_a_second() -> None:
    # one instance; every request is one 10-token step of 0.1 s and its only output token
    cost = MeasuredCost(
        prefill_base_s=0.1, prefill_per_token_s=0.0, decode_base_s=0.0, decode_per_seq_s=0.0
    )
    cfg = SimConfig(
        model=TOY,
        pools={Role.BOTH: PoolConfig(cost=cost, kv_capacity_tokens=10_000)},
        replicas={Role.BOTH: 1},
        chunk_size=10,  # one prompt per step
    )
    n = 200
    w = Workload(np.arange(n, dtype=float), np.full(n, 10), np.full(n, 1))  # evenly spaced
    g = goodput(cfg, w, Slo(ttft_s=0.15, tpot_s=1.0), rel_tol=0.01)
    # below 10/s every TTFT is 0.1 s; above, request k waits k (0.1 - 1/r) more, and 90 %
    # of them stay under 0.15 s only while 180 (0.1 - 1/r) <= 0.05, i.e. r <= 10.028/s
    assert 9.8 <= g.rate <= 10.03
    assert g.attainment >= 0.9
    assert g.per_gpu == g.rate
    assert all(a < 0.9 for r, a in g.probes if r > 10.03)


def test_splits_use_the_whole_budget() -> None:
    cost = MeasuredCost(0.01, 0.001, 0.02, 0.001)
    pool2 = PoolConfig(cost=cost, kv_capacity_tokens=1000, tp=2)
    base = SimConfig(
        model=TOY,
        pools={Role.PREFILL: pool2, Role.DECODE: pool2},
        replicas={Role.PREFILL: 1, Role.DECODE: 1},
        link=get_link("nvlink"),
    )
    splits = [(c.replicas[Role.PREFILL], c.replicas[Role.DECODE]) for c in
              disaggregated_splits(base, 8)]  # fmt: skip
    assert splits == [(1, 3), (2, 2), (3, 1)]
    assert all(c.gpus == 8 for c in disaggregated_splits(base, 8))
