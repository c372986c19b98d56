"""The disaggregation decision, with worked arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
from splitserve_worker.router.config import CostModelConfig
from splitserve_worker.router.decision import DecisionInput, Where, decide, transfer_exposed_s

pytestmark = pytest.mark.unit

COST = CostModelConfig(
    prefill_tokens_per_s=1000.0,
    decode_prefill_tokens_per_s=1000.0,
    link_bytes_per_s=1e9,
    kv_bytes_per_token=1e6,  # 1 ms per token over the link, all layers
    num_layers=10,
    handoff_overhead_s=0.01,
    short_prompt_tokens=32,
    decode_stall_weight=0.5,
)


def test_exposed_transfer_is_one_layer_share() -> None:
    # 1000 tokens * 1 MB / 1 GB/s = 1 s in all; one layer of ten is exposed
    assert transfer_exposed_s(1000, COST) == pytest.approx(0.1)


def test_short_prompt_stays_local() -> None:
    d = decide(DecisionInput(num_prompt_tokens=20), COST)
    assert d.where is Where.LOCAL and "short" in d.reason


def test_prompt_mostly_cached_on_decode_stays_local() -> None:
    d = decide(DecisionInput(num_prompt_tokens=2000, cached_on_decode_tokens=1990), COST)
    assert d.where is Where.LOCAL


def test_long_prompt_on_busy_decode_goes_remote() -> None:
    # remote: 1000/1000 + 0.1 + 0.01 = 1.11 s; local: 1.0 + 0.5 * 8 * 1.0 = 5.0 s
    d = decide(DecisionInput(num_prompt_tokens=1000, decode_running=8), COST)
    assert d.where is Where.REMOTE
    assert d.remote_s == pytest.approx(1.11)
    assert d.local_s == pytest.approx(5.0)


def test_long_prompt_on_idle_decode_with_busy_prefill_goes_local_without_the_limit() -> None:
    # remote: 3 s wait + 1.11 s; local: 1.0 s and nobody to stall
    free = CostModelConfig(**{**COST.__dict__, "max_decode_stall_s": float("inf")})
    d = decide(DecisionInput(num_prompt_tokens=1000, prefill_wait_s=3.0), free)
    assert d.where is Where.LOCAL
    assert d.remote_s == pytest.approx(4.11)
    assert d.local_s == pytest.approx(1.0)


def test_slow_link_keeps_prefill_local() -> None:
    slow = CostModelConfig(
        **{**COST.__dict__, "link_bytes_per_s": 1e7, "decode_stall_weight": 0.0,
           "max_decode_stall_s": float("inf")}
    )  # fmt: skip
    # exposed transfer: 1000 * 1e6 / 1e7 / 10 = 10 s
    d = decide(DecisionInput(num_prompt_tokens=1000, decode_running=4), slow)
    assert d.where is Where.LOCAL


def test_a_long_local_prefill_goes_remote_whatever_the_costs() -> None:
    # remote: 3 s wait + 1.11 s = 4.11 s; local: 1.0 + 0.5 * 1 * 1.0 = 1.5 s, cheaper, but
    # it would hold the decode worker for 1.0 s (limit 0.1 s): every stream there waits
    busy_prefill = DecisionInput(num_prompt_tokens=1000, prefill_wait_s=3.0, decode_running=1)
    d = decide(busy_prefill, COST)
    assert d.where is Where.REMOTE and "hold the decode worker for 1.000 s" in d.reason
    assert d.local_s < d.remote_s
    # idle now, but streams arriving during the prefill would wait as well
    idle = DecisionInput(num_prompt_tokens=1000, prefill_wait_s=3.0)
    assert decide(idle, COST).where is Where.REMOTE
    # a prefill within the limit (100 tokens: 0.1 s) is weighed by the costs as before
    short = DecisionInput(num_prompt_tokens=100, prefill_wait_s=3.0, decode_running=1)
    assert decide(short, COST).where is Where.LOCAL
    # no prefill worker: local anyway
    alone = DecisionInput(num_prompt_tokens=1000, decode_running=1, prefill_available=False)
    assert decide(alone, COST).where is Where.LOCAL


def test_no_prefill_worker_means_local() -> None:
    assert decide(DecisionInput(5000, prefill_available=False), COST).where is Where.LOCAL


def test_a_colocated_worker_weighs_a_prefill_worker_by_the_costs_alone() -> None:
    # an idle prefill worker: remote 1000/1000 + 0.1 + 0.01 = 1.11 s; local 1.0 + 0.5 * 2
    # * 1.0 = 2.0 s: the prefill worker spares the two streams the stall
    idle = DecisionInput(1000, decode_running=2, decode_is_colocated=True)
    d = decide(idle, COST)
    assert d.where is Where.REMOTE and d.remote_s == pytest.approx(1.11)
    assert d.local_s == pytest.approx(2.0)
    # a prefill worker with 3 s of prompts ahead: remote 4.11 s, local 2.0 s. A decode
    # worker proper would still send it remote (1.0 s of stall, limit 0.1 s); a colocated
    # one serves prompts by design and takes it
    queued = DecisionInput(1000, prefill_wait_s=3.0, decode_running=2, decode_is_colocated=True)
    d = decide(queued, COST)
    assert d.where is Where.LOCAL and d.local_s == pytest.approx(2.0)
    proper = dataclasses.replace(queued, decode_is_colocated=False)
    assert decide(proper, COST).where is Where.REMOTE
    # short prompts stay where they are
    assert decide(DecisionInput(20, decode_is_colocated=True), COST).where is Where.LOCAL


def test_prefix_cached_on_prefill_worker_makes_remote_cheaper() -> None:
    inp = DecisionInput(num_prompt_tokens=1000, cached_on_prefill_tokens=900, decode_running=1)
    d = decide(inp, COST)
    # remote: 0.1 + 0.1 + 0.01 = 0.21 s; local: 1.0 + 0.5 = 1.5 s
    assert d.where is Where.REMOTE and d.remote_s == pytest.approx(0.21)


def test_estimator_learns_kv_size_and_speeds() -> None:
    from splitserve_worker.router.decision import CostEstimator

    est = CostEstimator(
        CostModelConfig(
            prefill_tokens_per_s=1000, decode_prefill_tokens_per_s=1000, link_bytes_per_s=1e9
        ),
        alpha=0.5,
    )
    est.observe_compat(num_layers=30, kv_heads=3, head_dim=64, dtype="float32")
    assert est.cost.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 and est.cost.num_layers == 30
    est.observe_prefill(tokens=3000, prefill_s=1.0, bytes_sent=int(5e8), transfer_s=1.0)
    # halfway from 1000 to 3000 tok/s, and from 1 GB/s to 0.5 GB/s
    assert est.cost.prefill_tokens_per_s == pytest.approx(2000)
    assert est.cost.decode_prefill_tokens_per_s == pytest.approx(2000)
    assert est.cost.link_bytes_per_s == pytest.approx(7.5e8)
    est.observe_prefill(tokens=0, prefill_s=0.0, bytes_sent=0, transfer_s=0.0)  # nothing to learn
    assert est.cost.prefill_tokens_per_s == pytest.approx(2000)


def test_fixed_policies_override_the_cost_model() -> None:
    from splitserve_worker.router.decision import Policy

    short = DecisionInput(num_prompt_tokens=20)
    assert decide(short, COST, Policy.ALWAYS).where is Where.REMOTE
    busy = DecisionInput(num_prompt_tokens=1000, decode_running=8)
    assert decide(busy, COST, Policy.NEVER).where is Where.LOCAL
    # without a prefill worker even 'always' prefills locally
    alone = DecisionInput(num_prompt_tokens=1000, prefill_available=False)
    assert decide(alone, COST, Policy.ALWAYS).where is Where.LOCAL
