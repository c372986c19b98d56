"""Goodput: the highest request rate at which at least 90 % of requests meet both targets.

Found by search: the workload is replayed at scaled rates
(:meth:`Workload.at_rate`), bracketed by doubling or halving, then bisected
geometrically until the bracket is within ``rel_tol``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from splitserve_operator.sim.config import ConfigError, Mode, Role, SimConfig, Slo
from splitserve_operator.sim.metrics import SimResult
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.workload import Workload

TARGET_ATTAINMENT = 0.9
"""DistServe's definition: goodput is the rate served with >= 90 % SLO attainment."""


@dataclass(frozen=True)
class GoodputResult:
    config: SimConfig
    rate: float
    """Requests/s of the whole deployment (0 when even the lowest rate tried fails)."""
    attainment: float
    """Attainment measured at ``rate``."""
    evaluations: int
    probes: tuple[tuple[float, float], ...] = field(default=(), repr=False)
    """Every (rate, attainment) simulated, in order."""

    @property
    def gpus(self) -> int:
        return self.config.gpus

    @property
    def per_gpu(self) -> float:
        return self.rate / self.gpus if self.gpus else 0.0

    @property
    def label(self) -> str:
        return self.config.label()


QUEUE_HORIZON = 5.0
"""A probe replays at least the requests arriving in this many TTFT targets (the
workload tiled, up to ``MAX_TILES`` copies): fewer, and a burst far above
capacity could drain inside the TTFT target and look attained."""
MAX_TILES = 8

OVERLOAD = 1.0
"""Rates above this multiple of :func:`prefill_bound` count as missed without
simulating. Workloads with prefix hashes get ten times the room (reuse can
remove most of the prefill work)."""


def simulate(
    config: SimConfig, workload: Workload, rate: float | None = None, slo: Slo | None = None
) -> SimResult:
    """Run ``workload`` (at ``rate`` if given; tiled to cover ``QUEUE_HORIZON``
    TTFT targets when ``slo`` is given)."""
    w = workload if rate is None else workload.at_rate(rate)
    if slo is not None and rate is not None and len(w):
        need = rate * QUEUE_HORIZON * slo.ttft_s
        w = w.tiled(min(MAX_TILES, math.ceil(need / len(w))))
    return Simulator(config, w).run()


def prefill_bound(config: SimConfig, workload: Workload) -> float:
    """An upper bound on requests/s: the prefilling instances computing full
    steps of prompt tokens and nothing else (no attention, no decode, no reuse)."""
    role = Role.BOTH if config.mode is Mode.COLOCATED else Role.PREFILL
    pool = config.pools[role]
    step = config.chunk_size if config.mode is Mode.COLOCATED else config.max_prefill_tokens
    tokens_per_s = step / max(pool.cost.step_time(step, 0.0, 1, 0, 0), 1e-12)
    return max(1e-3, config.replicas[role] * tokens_per_s / max(1.0, workload.mean_prompt))


def first_guess(config: SimConfig, workload: Workload) -> float:
    """A rate near capacity to start the search from."""
    return prefill_bound(config, workload) / 2


def goodput(
    config: SimConfig,
    workload: Workload,
    slo: Slo,
    *,
    target: float = TARGET_ATTAINMENT,
    rel_tol: float = 0.04,
    max_evals: int = 30,
    start_rate: float | None = None,
    min_rate: float = 1e-4,
) -> GoodputResult:
    """Search the highest rate with attainment >= ``target`` (``workload``'s own
    arrival pattern, scaled)."""
    probes: list[tuple[float, float]] = []
    room = OVERLOAD * (10 if workload.hash_ids is not None else 1)
    ceiling = room * prefill_bound(config, workload)

    def att(rate: float) -> float:
        a = simulate(config, workload, rate, slo).attainment(slo) if rate <= ceiling else 0.0
        probes.append((rate, a))
        return a

    r = start_rate or first_guess(config, workload)
    a = att(r)
    if a >= target:
        lo, lo_a = r, a
        hi = r * 2
        while len(probes) < max_evals and (ha := att(hi)) >= target:
            lo, lo_a, hi = hi, ha, hi * 2
    else:
        hi = r
        lo = r / 2
        while (la := att(lo)) < target:
            hi, lo = lo, lo / 2
            if lo < min_rate or len(probes) >= max_evals:
                return GoodputResult(config, 0.0, la, len(probes), tuple(probes))
        lo_a = la
    while hi / lo > 1 + rel_tol and len(probes) < max_evals:
        mid = (lo * hi) ** 0.5
        ma = att(mid)
        if ma >= target:
            lo, lo_a = mid, ma
        else:
            hi = mid
    return GoodputResult(config, lo, lo_a, len(probes), tuple(probes))


@dataclass(frozen=True)
class SplitSearch:
    """Goodput of every configuration tried, and the best per GPU."""

    results: tuple[GoodputResult, ...]

    @property
    def best(self) -> GoodputResult:
        return max(self.results, key=lambda g: (g.per_gpu, -g.gpus))


def disaggregated_splits(base: SimConfig, gpus: int) -> list[SimConfig]:
    """Every prefill:decode split of ``gpus`` GPUs (at least one of each)."""
    tp_p = base.pools[Role.PREFILL].tp
    tp_d = base.pools[Role.DECODE].tp
    out = []
    for p in range(1, gpus // tp_p + 1):
        d = (gpus - p * tp_p) // tp_d
        if d >= 1:
            out.append(base.with_replicas(prefill=p, decode=d))
    return out


def best_disaggregated(
    base: SimConfig, workload: Workload, slo: Slo, gpus: int, **search: float
) -> SplitSearch:
    configs = disaggregated_splits(base, gpus)
    if not configs:
        raise ConfigError(f"{gpus} GPUs cannot hold one prefill and one decode instance")
    return SplitSearch(tuple(goodput(c, workload, slo, **search) for c in configs))  # type: ignore[arg-type]


def best_colocated(
    base: SimConfig,
    workload: Workload,
    slo: Slo,
    gpus: int,
    chunk_sizes: Sequence[int] = (256, 512, 1024, 2048),
    **search: float,
) -> SplitSearch:
    n = gpus // base.pools[Role.BOTH].tp
    if n < 1:
        raise ConfigError(f"{gpus} GPUs cannot hold one instance at tp={base.pools[Role.BOTH].tp}")
    configs = [replace(base.with_replicas(both=n), chunk_size=c) for c in chunk_sizes]
    return SplitSearch(tuple(goodput(c, workload, slo, **search) for c in configs))  # type: ignore[arg-type]
