"""The event loop against timelines worked out by hand, and the planner's API.

Costs here are :class:`MeasuredCost` with round numbers, so every time below
is a sum a reader can check: prefill ``base + per_token * tokens``, a decode
step ``base + per_seq * sequences``.
"""

from __future__ import annotations

import numpy as np
import pytest
from splitserve_operator.sim.config import ConfigError, PoolConfig, Role, SimConfig, Slo
from splitserve_operator.sim.cost import MeasuredCost
from splitserve_operator.sim.hardware import LinkSpec
from splitserve_operator.sim.model_spec import ModelSpec
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.workload import Request, Workload, poisson

pytestmark = pytest.mark.unit

# 4 layers, 1 KV head of dim 4, 2 bytes: 2 * 4 * 1 * 4 * 2 = 64 bytes of KV per token
TOY = ModelSpec(
    "toy", layers=4, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10
)
COST = MeasuredCost(
    prefill_base_s=0.01, prefill_per_token_s=0.001, decode_base_s=0.02, decode_per_seq_s=0.001
)
LINK = LinkSpec("toy-link", "128 kB/s", bandwidth=128_000)  # 100 tokens (6,400 B) in 0.05 s


def pool(cost: MeasuredCost = COST, kv: int = 100_000, max_seqs: int = 64) -> PoolConfig:
    return PoolConfig(cost=cost, kv_capacity_tokens=kv, max_seqs=max_seqs)


def disagg(prefill: PoolConfig | None = None, decode: PoolConfig | None = None, **kw) -> SimConfig:  # type: ignore[no-untyped-def]
    return SimConfig(
        model=TOY,
        pools={Role.PREFILL: prefill or pool(), Role.DECODE: decode or pool()},
        replicas={Role.PREFILL: kw.pop("p", 1), Role.DECODE: kw.pop("d", 1)},
        link=kw.pop("link", LINK),
        **kw,
    )


def colocated(chunk: int = 32, n: int = 1, **kw) -> SimConfig:  # type: ignore[no-untyped-def]
    return SimConfig(
        model=TOY, pools={Role.BOTH: pool()}, replicas={Role.BOTH: n}, chunk_size=chunk, **kw
    )


def table(*rows: tuple[float, int, int], hashes=None, block=512) -> Workload:  # type: ignore[no-untyped-def]
    return Workload(
        np.array([r[0] for r in rows], dtype=float),
        np.array([r[1] for r in rows], dtype=np.int64),
        np.array([r[2] for r in rows], dtype=np.int64),
        hashes,
        block_tokens=block,
    )


def by_id(sim: Simulator) -> dict[int, Request]:
    return {r.rid: r for r in sim.finished}


def test_one_disaggregated_request() -> None:
    sim = Simulator(disagg(layerwise=False), table((0.0, 100, 11)))
    sim.run()
    r = by_id(sim)[0]
    # prefill 0.01 + 100 * 0.001 = 0.11; then all 6,400 bytes at 128 kB/s = 0.05
    assert r.t_first == pytest.approx(0.16)
    # 10 decode steps of 0.02 + 1 * 0.001
    assert r.t_last == pytest.approx(0.16 + 10 * 0.021)
    assert r.tpot == pytest.approx(0.021)


def test_layerwise_transfer_starts_after_the_first_layer() -> None:
    sim = Simulator(disagg(layerwise=True), table((0.0, 100, 11)))
    sim.run()
    # layer 1 of 4 done at 0.11 / 4 = 0.0275, sending takes 0.05 -> 0.0775; but the last
    # layer's share (0.05 / 4) can only leave after prefill ends: 0.11 + 0.0125 = 0.1225
    assert by_id(sim)[0].t_first == pytest.approx(0.1225)


def test_first_token_at_prefill_end_when_configured() -> None:
    sim = Simulator(
        disagg(layerwise=False, first_token_after_transfer=False), table((0.0, 100, 11))
    )
    sim.run()
    r = by_id(sim)[0]
    assert r.t_first == pytest.approx(0.11)
    # decode waits for the KV (0.16), so the transfer shows in TPOT instead
    assert r.t_last == pytest.approx(0.16 + 10 * 0.021)


def test_one_colocated_request_in_chunks() -> None:
    sim = Simulator(colocated(chunk=32), table((0.0, 100, 11)))
    sim.run()
    r = by_id(sim)[0]
    # chunks of 32, 32, 32 and 4 tokens, each step 0.01 + 0.001 * tokens
    assert r.t_first == pytest.approx(3 * 0.042 + 0.014)
    assert r.tpot == pytest.approx(0.021)


def test_colocated_chunk_shares_a_step_with_decode() -> None:
    # A decodes alone; B (20 tokens, one chunk) arrives at 0.5 and rides in A's next step
    sim = Simulator(colocated(chunk=32), table((0.0, 10, 100), (0.5, 20, 2)))
    sim.run()
    a, b = by_id(sim)[0], by_id(sim)[1]
    t_a1 = 0.01 + 10 * 0.001  # A's prefill: 0.02
    # A's decode steps of 0.021 from 0.02: the boundary at or after 0.5 is step 23 (0.503)
    boundary = t_a1 + 23 * 0.021
    assert boundary >= 0.5 > t_a1 + 22 * 0.021
    mixed = (0.01 + 20 * 0.001) + (0.02 + 1 * 0.001)  # B's chunk plus A's decode
    assert b.t_first == pytest.approx(boundary + mixed)
    # then both decode: B's last token one step of two sequences later
    assert b.t_last == pytest.approx(boundary + mixed + 0.022)
    # A: 99 decode tokens; 23 alone, one mixed, one with B, 74 alone again
    assert a.t_last == pytest.approx(t_a1 + 23 * 0.021 + mixed + 0.022 + 74 * 0.021)


def test_decode_span_is_cut_at_the_next_step_boundary() -> None:
    flat = MeasuredCost(0.0, 0.001, 0.01, 0.0)  # prefill 1 ms/token; decode 10 ms/step
    instant = LinkSpec("instant", "", bandwidth=1e30)
    cfg = disagg(prefill=pool(flat), decode=pool(flat), link=instant, layerwise=False)
    sim = Simulator(cfg, table((0.0, 10, 101), (0.0155, 10, 3)))
    sim.run()
    a, b = by_id(sim)[0], by_id(sim)[1]
    # A decodes from 0.01 in steps ending 0.02, 0.03, ...; B's KV lands at 0.0255,
    # joins at 0.03, and decodes its two tokens by 0.05
    assert b.t_first == pytest.approx(0.0255)
    assert b.t_last == pytest.approx(0.05)
    assert b.tpot == pytest.approx(0.01225)
    assert a.t_last == pytest.approx(0.01 + 100 * 0.01)


def test_a_reservation_that_does_not_fit_waits() -> None:
    flat = MeasuredCost(0.0, 0.001, 0.01, 0.0)
    instant = LinkSpec("instant", "", bandwidth=1e30)
    cfg = disagg(prefill=pool(flat), decode=pool(flat, kv=150), link=instant, layerwise=False)
    sim = Simulator(cfg, table((0.0, 100, 20), (0.15, 20, 20)))
    sim.run()
    a, b = by_id(sim)[0], by_id(sim)[1]
    assert a.t_last == pytest.approx(0.1 + 19 * 0.01)  # 0.29
    # B needs 40 tokens, A holds 120 of 150: B's KV (landed 0.17) waits for A to finish
    assert b.t_first == pytest.approx(0.17)
    assert b.t_last == pytest.approx(0.29 + 19 * 0.01)


def test_prefix_cache_skips_the_shared_blocks() -> None:
    w = table((0.0, 64, 2), (10.0, 64, 2), hashes=[(1, 2, 3, 4), (1, 2, 3, 5)], block=16)
    sim = Simulator(disagg(layerwise=False), w)
    sim.run()
    a, b = by_id(sim)[0], by_id(sim)[1]
    transfer = 64 * 64 / 128_000  # the whole prompt's KV still goes to decode
    assert a.t_first - a.arrival == pytest.approx(0.01 + 64 * 0.001 + transfer)
    assert b.cached == 48  # blocks 1, 2, 3
    assert b.t_first - b.arrival == pytest.approx(0.01 + 16 * 0.001 + transfer)
    off = Simulator(disagg(layerwise=False, prefix_caching=False), w)
    off.run()
    assert by_id(off)[1].t_first - 10.0 == pytest.approx(a.t_first)


def test_router_spreads_load_and_prefers_the_cached_prefix() -> None:
    # two prefill instances; request 2 shares request 0's prefix and should follow it
    w = table(
        (0.0, 64, 2), (0.0, 64, 2), (5.0, 64, 2),
        hashes=[(1, 2, 3, 4), (7, 8, 9, 10), (1, 2, 3, 11)], block=16,
    )  # fmt: skip
    sim = Simulator(disagg(p=2, layerwise=False), w)
    sim.run()
    assert by_id(sim)[1].t_first == pytest.approx(by_id(sim)[0].t_first)  # in parallel
    assert by_id(sim)[2].cached == 48


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_request_finishes_and_tokens_add_up(mode: str, seed: int) -> None:
    w = poisson(20.0, 300, 200, 30, seed=seed)
    rng = np.random.default_rng(seed)
    w = Workload(w.arrival, rng.integers(1, 400, 300), rng.integers(1, 60, 300))
    cfg = colocated(chunk=64, n=2) if mode == "colocated" else disagg(p=2, d=2)
    sim = Simulator(cfg, w)
    t, out_tokens, arrivals, completed = 0.0, 0.0, 0, 0
    while not sim.done:
        t += 0.7
        win = sim.run_until(t)
        out_tokens += win.output_token_rate * win.duration
        arrivals += win.arrivals
        completed += win.completed
    res = sim.result()
    assert res.n_finished == res.n_requests == arrivals == completed == 300
    assert out_tokens == pytest.approx(int(w.output.sum()))
    assert np.all(res.ttft > 0) and np.all(res.tpot >= 0)
    assert np.all(res.finish >= res.arrival + res.ttft - 1e-12)


# ---- the planner's API ----


def test_windows_gpu_seconds_and_startup() -> None:
    w = poisson(2.0, 2000, 50, 10, seed=0)
    sim = Simulator(disagg(startup_s=10.0), w, slo=Slo(1.0, 0.1))
    w1 = sim.run_until(100.0)
    assert (w1.t_start, w1.t_end, w1.gpus) == (0.0, 100.0, 2)
    assert w1.gpu_seconds == pytest.approx(200.0)
    assert w1.request_rate == pytest.approx(w1.arrivals / 100.0)
    assert w1.ttft is not None and w1.tpot is not None and w1.slo_attainment is not None
    sim.set_replicas(decode=2)
    w2 = sim.run_until(105.0)
    assert w2.pools["decode"].starting == 1 and w2.pools["decode"].active == 1
    w3 = sim.run_until(200.0)
    assert w3.pools["decode"].active == 2 and w3.gpus == 3
    # 2 GPUs for 100 s plus the new one from 100 s (starting counts): 300 over both windows
    assert w2.gpu_seconds + w3.gpu_seconds == pytest.approx(300.0)
    assert sim.gpu_seconds() == pytest.approx(500.0)
    assert sim.replicas(Role.DECODE) == 2
    with pytest.raises(ConfigError):
        sim.set_replicas(both=1)


def test_draining_instance_finishes_its_work_then_goes() -> None:
    flat = MeasuredCost(0.0, 0.001, 0.01, 0.0)
    cfg = disagg(prefill=pool(flat), decode=pool(flat), d=2, layerwise=False)
    # long outputs so both decode instances are busy when one is removed
    sim = Simulator(cfg, table((0.0, 10, 500), (0.0, 10, 500)))
    sim.run_until(1.0)
    sim.set_replicas(decode=1)
    obs = sim.observe()
    assert obs.pools["decode"].draining == 1 and obs.pools["decode"].active == 1
    res = sim.run()
    assert res.n_finished == 2
    assert sim.observe().pools["decode"].draining == 0
    # the drained instance held its GPU until its request finished (~5 s), not until 1 s
    assert sim.gpu_seconds() > 2 * 1.0 + 2 * 4.0


def test_scale_to_zero_queues_at_the_router() -> None:
    sim = Simulator(disagg(), table((1.0, 10, 2), (2.0, 10, 2), (20.0, 10, 2)))
    sim.set_replicas(prefill=0)
    w = sim.run_until(5.0)
    assert w.pools["prefill"].queue == 2 and w.pools["prefill"].active == 0
    sim.set_replicas(prefill=1)
    res = sim.run()
    assert res.n_finished == 3
    assert by_id(sim)[0].t_first > 5.0


def test_lazy_request_iterables_are_accepted() -> None:
    def gen():  # type: ignore[no-untyped-def]
        for i in range(50):
            yield Request(i, i * 0.1, 20, 5)

    res = Simulator(colocated(), gen()).run()
    assert res.n_finished == 50


def test_router_prefills_locally_when_short_or_cheaper() -> None:
    from splitserve_operator.sim.config import LocalPrefill

    cfg = disagg(layerwise=False, local_prefill=LocalPrefill(), chunk_size=512)
    # 0: short (<= 64 tokens) -> local; 1: 100 tokens, decode idle -> local (no handoff);
    # 2: 100 tokens while request 1 decodes -> local would stall it: remote
    w = table((0.0, 50, 2), (10.0, 100, 40), (10.5, 100, 2))
    sim = Simulator(cfg, w)
    res = sim.run()
    r = by_id(sim)
    assert r[0].t_first - r[0].arrival == pytest.approx(0.01 + 50 * 0.001)  # no transfer
    assert r[1].t_first - r[1].arrival == pytest.approx(0.01 + 100 * 0.001)
    # the router's estimates: local 100/2000 * (1 + 0.5 * 1 running) = 0.075 s, remote
    # 100/2000 + 0.005 = 0.055 s; so prefill worker, then 6,400 bytes at 128 kB/s
    assert r[2].t_first - r[2].arrival == pytest.approx(0.11 + 0.05)
    assert res.extra["local_prefills"] == 2
