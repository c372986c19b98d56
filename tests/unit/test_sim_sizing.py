"""What a rate costs: the pure colocate-or-split decision (a table), the candidates and
tensor-parallel sizes tried, the fewest-GPUs search on a server of known capacity, and
the advice it leads to, down to the InferenceService it prints (which the CRD and the
operator accept)."""

from __future__ import annotations

import numpy as np
import pytest
from crd_validation import problems
from splitserve_operator.api.parse import parse_spec
from splitserve_operator.sim.advise import advise, workload_for_advice
from splitserve_operator.sim.config import ConfigError, Mode, PoolConfig, Role, SimConfig, Slo
from splitserve_operator.sim.cost import MeasuredCost
from splitserve_operator.sim.hardware import get_gpu, get_link
from splitserve_operator.sim.model_spec import ModelSpec, load_model_spec
from splitserve_operator.sim.sizing import (
    Basis,
    colocated_candidates,
    decide,
    disaggregated_candidates,
    fewest_gpus,
    tp_options,
)
from splitserve_operator.sim.workload import Workload

pytestmark = pytest.mark.unit

C, D = Mode.COLOCATED, Mode.DISAGGREGATED

# colocated GPUs at the rate, disaggregated GPUs at the rate, goodput per GPU at scale
# colocated, disaggregated -> the mode and what decided it
DECISIONS = [
    # the rate's own cost decides, whatever the figures at scale say
    ("fewer colocated, though split wins at scale", (1, 2, 85.0, 110.0), C, Basis.FEWER_GPUS),
    ("fewer split, though colocated wins at scale", (6, 4, 3.0, 2.0), D, Basis.FEWER_GPUS),
    ("as many either way: the simpler one", (4, 4, 1.0, 2.0), C, Basis.TIE),
    ("only colocated within the budget", (8, None, 0.5, 0.9), C, Basis.ONLY_ONE),
    ("only split within the budget", (None, 7, 0.9, 0.5), D, Basis.ONLY_ONE),
    # neither serves the rate: per GPU at scale, a split needs a 5 % lead
    ("neither; split 10 % ahead at scale", (None, None, 1.0, 1.1), D, Basis.AT_SCALE),
    ("neither; split 4 % ahead at scale", (None, None, 1.0, 1.04), C, Basis.AT_SCALE),
    ("neither; colocated ahead at scale", (None, None, 1.2, 1.0), C, Basis.AT_SCALE),
    ("neither; only split meets the SLO at all", (None, None, 0.0, 0.3), D, Basis.AT_SCALE),
    ("neither meets the SLO at any rate", (None, None, 0.0, 0.0), C, Basis.NEITHER),
]


@pytest.mark.parametrize(
    ("figures", "mode", "basis"),
    [d[1:] for d in DECISIONS],
    ids=[d[0] for d in DECISIONS],
)
def test_the_decision_goes_by_what_the_rate_costs(
    figures: tuple[int | None, int | None, float, float], mode: Mode, basis: Basis
) -> None:
    decision = decide(*figures)
    assert (decision.mode, decision.basis) == (mode, basis)


def test_tensor_parallel_sizes_tried_start_where_the_weights_fit() -> None:
    h100, h200 = get_gpu("h100"), get_gpu("h200")
    m8, m70 = load_model_spec("llama-3.1-8b"), load_model_spec("llama-3.1-70b")
    assert tp_options(m8, h100, 8) == (1, 2, 4, 8)
    assert tp_options(m8, h100, 3) == (1, 2)  # not past the budget
    assert tp_options(m70, h100, 16) == (4, 8)  # not past one server
    assert tp_options(m70, h200, 8) == (2, 4, 8)
    assert tp_options(m70, h100, 8, fixed=8) == (8,)
    with pytest.raises(ConfigError, match="give --gpus 4 or more"):
        tp_options(m70, h100, 2)


def test_candidates_cover_every_split_and_tp_pair_within_the_budget() -> None:
    m = load_model_spec("llama-3.1-8b")
    h100 = get_gpu("h100")
    dis = disaggregated_candidates(m, h100, h100, get_link("nvlink"), (1, 2), (1, 2), 4)
    shapes = {
        (c.replicas[Role.PREFILL], c.pools[Role.PREFILL].tp, c.replicas[Role.DECODE],
         c.pools[Role.DECODE].tp) for c in dis
    }  # fmt: skip
    assert shapes == {
        (1, 1, 1, 1), (1, 1, 2, 1), (1, 1, 3, 1), (2, 1, 1, 1), (2, 1, 2, 1), (3, 1, 1, 1),
        (1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 2),
    }  # fmt: skip
    assert len(shapes) == len(dis) and all(c.gpus <= 4 for c in dis)
    col = colocated_candidates(m, h100, (1, 2), (256, 1024), 4)
    assert sorted((c.replicas[Role.BOTH], c.pools[Role.BOTH].tp, c.chunk_size) for c in col) == [
        (1, 1, 256), (1, 1, 1024), (1, 2, 256), (1, 2, 1024), (2, 1, 256), (2, 1, 1024),
        (2, 2, 256), (2, 2, 1024), (3, 1, 256), (3, 1, 1024), (4, 1, 256), (4, 1, 1024),
    ]  # fmt: skip


TOY = ModelSpec(
    "toy", layers=4, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10
)


def _servers(n: int) -> SimConfig:
    # every request is one 10-token step of 0.1 s and its only output token: one server
    # serves 10 requests/s
    cost = MeasuredCost(
        prefill_base_s=0.1, prefill_per_token_s=0.0, decode_base_s=0.0, decode_per_seq_s=0.0
    )
    return SimConfig(
        model=TOY,
        pools={Role.BOTH: PoolConfig(cost=cost, kv_capacity_tokens=10_000)},
        replicas={Role.BOTH: n},
        chunk_size=10,
    )


def test_the_fewest_servers_that_keep_up_with_the_rate() -> None:
    n = 300
    slo = Slo(ttft_s=0.25, tpot_s=1.0)
    # 25 requests/s evenly spaced: two servers (20/s) fall further behind with every
    # request, three keep up (a prompt waits at most one step for its server)
    w = Workload(np.arange(n) / 25.0, np.full(n, 10), np.full(n, 1))
    found = fewest_gpus([_servers(k) for k in (5, 1, 3, 2, 4)], w, slo)
    assert found is not None
    assert found.gpus == 3 and found.attainment == 1.0
    assert 0.1 <= found.ttft_p90 <= 0.25
    # one and two servers (10/s, 20/s of prompts) are passed over without simulating
    assert found.tried == 1
    assert fewest_gpus([_servers(k) for k in (1, 2)], w, slo) is None
    # a TTFT below one step's 0.1 s: nothing meets it, at any size
    assert fewest_gpus([_servers(k) for k in (1, 2, 3, 4)], w, Slo(0.05, 1.0)) is None


def test_the_issues_example_colocates_on_one_gpu() -> None:
    """llama-3.1-8b on H100s at 20 req/s of 200-token prompts and outputs: one colocated
    GPU serves it within the SLO, a split needs two; goodput per GPU at scale favours the
    split, and is reported beside the decision, not as it."""
    a = advise(
        load_model_spec("llama-3.1-8b"),
        get_gpu("h100"),
        get_link("pcie4"),
        Slo(ttft_s=2.0, tpot_s=0.1),
        workload_for_advice(20, 200, 200),
        gpus=8,
    )
    assert a.colocated_at_rate is not None and a.disaggregated_at_rate is not None
    assert (a.colocated_at_rate.gpus, a.disaggregated_at_rate.gpus) == (1, 2)
    assert a.recommendation is Mode.COLOCATED and a.decision.basis is Basis.FEWER_GPUS
    assert a.disaggregated.per_gpu > a.colocated.per_gpu  # at scale: the other way
    assert a.deployment.gpus == 1
    assert a.tensor_parallel == {"prefill": 1, "decode": 1}
    service = a.inference_service()
    assert service["spec"]["decode"] == {"replicas": 1, "gpus": 1, "tensorParallelSize": 1}
    assert service["spec"]["prefill"]["replicas"] == 0
    assert service["spec"]["router"] == {"settings": {"disaggregation": "never"}}
    _accepted(service)


def test_decode_and_colocated_need_no_more_than_one_rank_for_a_model_one_gpu_holds() -> None:
    """Long prompts on tight TTFT: every pool is searched from one rank up; decode and
    colocated serve the rate on the fewest GPUs at one rank, and the printed
    InferenceService passes the CRD and the operator."""
    a = advise(
        load_model_spec("llama-3.1-8b"),
        get_gpu("h100"),
        get_link("nvlink"),
        Slo(ttft_s=0.3, tpot_s=0.1),
        workload_for_advice(2.0, 4000, 50, n=200),
        gpus=8,
        chunk_sizes=(2048,),
        max_requests=200,
    )
    assert a.tensor_parallel["decode"] == 1
    assert a.disaggregated.config.pools[Role.DECODE].tp == 1
    assert a.colocated.config.pools[Role.BOTH].tp == 1
    spec = a.inference_service()["spec"]
    assert spec["decode"]["gpus"] == spec["decode"]["tensorParallelSize"] == 1
    _accepted(a.inference_service())


def test_a_model_larger_than_one_gpu_is_sized_over_ranks_in_every_pool() -> None:
    """llama-3.1-70b does not fit one H100: every pool (decode and colocated too, whose
    workers run over ranks as prefill's do) is sized from the four ranks that hold it,
    the printed InferenceService passes the CRD and the operator, and a budget below one
    worker is refused saying what to give."""
    args = (
        get_gpu("h100"),
        get_link("nvlink"),
        Slo(ttft_s=4.0, tpot_s=0.1),
        workload_for_advice(1.0, 2000, 100, n=50),
    )
    m70 = load_model_spec("llama-3.1-70b")
    a = advise(m70, *args, gpus=16, chunk_sizes=(2048,), max_requests=50)
    assert all(tp >= 4 for tp in a.tensor_parallel.values()), a.tensor_parallel
    assert a.colocated.config.pools[Role.BOTH].tp >= 4
    _accepted(a.inference_service())
    with pytest.raises(ConfigError, match=r"needs 4 x h100 per worker: give --gpus 4 or more"):
        advise(m70, *args, gpus=2, max_requests=50)


def test_given_sizes_are_used_for_each_pool() -> None:
    a = advise(
        load_model_spec("llama-3.1-8b"),
        get_gpu("h100"),
        get_link("pcie4"),
        Slo(ttft_s=2.0, tpot_s=0.1),
        workload_for_advice(5, 200, 50, n=200),
        gpus=4,
        prefill_tp=2,
        decode_tp=1,
        chunk_sizes=(512,),
        max_requests=200,
    )
    dis = a.disaggregated_at_rate
    assert dis is not None
    assert (dis.tensor_parallel(Role.PREFILL), dis.tensor_parallel(Role.DECODE)) == (2, 1)
    assert a.disaggregated.config.pools[Role.PREFILL].tp == 2  # at scale too


def _accepted(service: dict[str, object]) -> None:
    """The API server (the CRD's schema and rules) and the operator both take it."""
    assert problems(service) == []
    spec = service["spec"]
    assert isinstance(spec, dict)
    parse_spec(spec, name="advised")
