"""Tensor parallelism in the simulator: the heads a handoff moves between two layouts
(worked out by hand here, and the invariants for any layout), the handoff's time with a
link per rank or one per worker, and a pool's TP in its costs, capacity and GPU count."""

from __future__ import annotations

import pytest
from fuzz_profiles import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from splitserve_operator.sim.config import Mode, Role, roofline_config
from splitserve_operator.sim.cost import RooflineCost, kv_fanout, rank_heads
from splitserve_operator.sim.hardware import get_gpu, get_link
from splitserve_operator.sim.model_spec import load_model_spec
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.workload import poisson

pytestmark = pytest.mark.unit

# (kv heads, prefill tp, decode tp) -> heads each prefill rank sends, each decode rank
# receives, and the rank pairs that talk
FANOUTS = [
    ("equal", (8, 2, 2), (4, 4), (4, 4), 2),
    ("fan-in, p > d", (8, 2, 1), (4, 4), (8,), 2),
    ("fan-out, p < d", (8, 1, 2), (8,), (4, 4), 2),
    ("4 to 2", (8, 4, 2), (2, 2, 2, 2), (4, 4), 4),
    ("2 to 4", (8, 2, 4), (4, 4), (2, 2, 2, 2), 4),
    # 2 KV heads on 4 decode ranks: each head lives on two of them and is sent twice
    ("decode replicates", (2, 1, 4), (4,), (1, 1, 1, 1), 4),
    # 2 KV heads on 4 prefill ranks: one copy of each is enough, from different ranks
    ("prefill replicates", (2, 4, 1), (1, 0, 1, 0), (2,), 2),
    ("both replicate", (2, 4, 4), (1, 1, 1, 1), (1, 1, 1, 1), 4),
    ("smollm2's 3 heads, 1 to 3", (3, 1, 3), (3,), (1, 1, 1), 3),
]


@pytest.mark.parametrize(
    ("layout", "sent", "received", "pairs"),
    [f[1:] for f in FANOUTS],
    ids=[f[0] for f in FANOUTS],
)
def test_each_decode_rank_gets_its_heads_from_a_prefill_rank_that_holds_them(
    layout: tuple[int, int, int], sent: tuple[int, ...], received: tuple[int, ...], pairs: int
) -> None:
    fanout = kv_fanout(*layout)
    assert (fanout.sent, fanout.received, fanout.pairs) == (sent, received, pairs)


def test_ranks_hold_an_even_share_or_one_replicated_head() -> None:
    assert [list(rank_heads(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(rank_heads(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert list(rank_heads(8, 1, 0)) == list(range(8))
    with pytest.raises(ValueError, match="at least 1"):
        kv_fanout(8, 0, 1)


@settings(max_examples=scaled(80), deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 3, 4, 8, 16]),
    p=st.sampled_from([1, 2, 4, 8]),
    d=st.sampled_from([1, 2, 4, 8]),
)
def test_every_layout_moves_each_decode_ranks_heads_once(kv_heads: int, p: int, d: int) -> None:
    if any(kv_heads % tp and tp % kv_heads for tp in (p, d)):
        return  # uneven splits or replicas are not a layout the engine makes
    fanout = kv_fanout(kv_heads, p, d)
    assert fanout.received == tuple(len(rank_heads(kv_heads, d, j)) for j in range(d))
    assert sum(fanout.sent) == fanout.total >= kv_heads
    assert fanout.total == kv_heads * max(1, d // kv_heads)
    assert 1 <= fanout.pairs <= p * d
    # no prefill rank sends more than it would if one rank had to send everything
    assert max(fanout.sent) <= fanout.total


def _handoff(p: int, d: int, **knobs: object) -> float:
    cfg = roofline_config(
        load_model_spec("llama-3.1-8b"),
        Mode.DISAGGREGATED,
        get_gpu("h100"),
        link=get_link("pcie4"),
        prefill_tp=p,
        decode_tp=d,
        **knobs,
    )
    return cfg.handoff_s(1000)


def test_a_handoff_takes_as_long_as_its_busiest_rank() -> None:
    # llama-3.1-8b: 32 layers, 8 KV heads of 128 in bf16: 16 KiB per head and token, so
    # 1,000 tokens of all 8 heads are 131,072,000 bytes; pcie4 moves 32e9 bytes/s
    whole = 131_072_000 / 32e9
    assert _handoff(1, 1) == pytest.approx(whole, rel=1e-12)
    assert _handoff(2, 2) == pytest.approx(whole / 2, rel=1e-12)  # each rank its half
    assert _handoff(4, 4) == pytest.approx(whole / 4, rel=1e-12)
    # p != d: the side with fewer ranks carries more per rank
    assert _handoff(2, 1) == pytest.approx(whole, rel=1e-12)
    assert _handoff(1, 2) == pytest.approx(whole, rel=1e-12)
    assert _handoff(4, 2) == pytest.approx(whole / 2, rel=1e-12)
    # one link per worker: everything crosses it, whatever the layout
    assert _handoff(4, 2, link_per_rank=False) == pytest.approx(whole, rel=1e-12)


def test_a_decode_worker_that_replicates_heads_receives_more() -> None:
    # smollm2-135m has 3 KV heads; 6 decode ranks hold each head twice
    m = load_model_spec("smollm2-135m")
    assert kv_fanout(m.kv_heads, 1, 6).total == 6
    cfg = roofline_config(
        m, Mode.DISAGGREGATED, get_gpu("h100"), link=get_link("pcie4"), prefill_tp=1, decode_tp=6
    )
    shared = roofline_config(
        m, Mode.DISAGGREGATED, get_gpu("h100"), link=get_link("pcie4"), prefill_tp=1, decode_tp=1
    )
    # one prefill rank sends 6 head copies instead of 3
    assert cfg.handoff_s(500) == pytest.approx(2 * shared.handoff_s(500), rel=1e-12)


def test_prefill_and_decode_pools_take_their_own_tensor_parallelism() -> None:
    m = load_model_spec("llama-3.1-70b")
    cfg = roofline_config(
        m, Mode.DISAGGREGATED, get_gpu("h100"), link=get_link("nvlink"), prefill_tp=8,
        decode_tp=4, prefill=1, decode=2,
    )  # fmt: skip
    pre, dec = cfg.pools[Role.PREFILL], cfg.pools[Role.DECODE]
    assert (pre.tp, dec.tp) == (8, 4)
    assert cfg.gpus == 8 + 2 * 4
    assert cfg.label() == "disaggregated 1P(tp8):2D(tp4)"
    # each rank holds its share of the weights: more ranks leave more room for KV
    assert pre.kv_capacity_tokens > dec.kv_capacity_tokens
    # unset, each pool takes the smallest size its weights fit (4 x H100 for 70B)
    default = roofline_config(m, Mode.DISAGGREGATED, get_gpu("h100"), link=get_link("nvlink"))
    assert (default.pools[Role.PREFILL].tp, default.pools[Role.DECODE].tp) == (4, 4)


def test_more_ranks_split_the_work_and_pay_the_all_reduces() -> None:
    m = load_model_spec("llama-3.1-8b")
    h100 = get_gpu("h100")
    one, two = RooflineCost(m, h100, 1), RooflineCost(m, h100, 2)
    # a big prefill step is compute-bound: two ranks take a bit more than half the time
    big1, big2 = (
        one.step_time(4096, 4096 * 4097 / 2, 1, 0, 0),
        two.step_time(4096, 4096 * 4097 / 2, 1, 0, 0),
    )
    assert big1 / 2 < big2 < big1
    assert big2 - two.comm_time(4096) == pytest.approx(
        one.step_overhead_s + (big1 - one.step_overhead_s) / 2, rel=1e-9
    )
    # a decode step streams half the weights per rank, plus two all-reduces per layer
    dec1, dec2 = one.step_time(0, 0, 0, 16, 16 * 400), two.step_time(0, 0, 0, 16, 16 * 400)
    assert dec2 < dec1
    assert dec2 > two.comm_time(16) + one.step_overhead_s


def test_the_simulated_ttft_pays_the_fanned_in_handoff() -> None:
    """One long prompt at a time: P(tp2) to D(tp1) lands later than P(tp2) to D(tp2),
    by the extra time one decode rank's link takes to take all the heads."""
    m = load_model_spec("llama-3.1-8b")
    w = poisson(0.05, 5, 8000, 2, seed=1)

    def ttft(d: int) -> float:
        cfg = roofline_config(
            m, Mode.DISAGGREGATED, get_gpu("h100"), link=get_link("pcie4"), prefill_tp=2,
            decode_tp=d, layerwise=False,
        )  # fmt: skip
        return float(Simulator(cfg, w).run().ttft.mean())

    fan_in, equal = ttft(1), ttft(2)
    extra = 8000 * m.kv_bytes_per_token / 32e9 / 2  # the second half of the KV, serially
    assert fan_in - equal == pytest.approx(extra, rel=1e-6)
