"""What a rate costs: the fewest GPUs that serve it within the SLO, each way, and the
decision between the two ways.

:func:`fewest_gpus` simulates candidate deployments at the workload's own rate in
order of their GPU count (prefill:decode split, tensor parallelism per pool and chunk
size searched) and keeps the first count at which one attains the SLO.
:func:`decide` is the pure rule that turns the two answers, and goodput per GPU at
scale, into a recommendation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from splitserve_operator.sim.config import (
    ConfigError,
    Mode,
    Role,
    SimConfig,
    Slo,
    pick_tp,
    roofline_config,
)
from splitserve_operator.sim.goodput import OVERLOAD, TARGET_ATTAINMENT, prefill_bound, simulate
from splitserve_operator.sim.hardware import GpuSpec, LinkSpec
from splitserve_operator.sim.model_spec import ModelSpec
from splitserve_operator.sim.workload import Workload

MAX_TP = 8
"""The largest tensor-parallel size tried: the GPUs of one server (its all-reduces stay
on NVLink)."""

WIN_MARGIN = 0.05
"""When neither way serves the rate within the budget, disaggregation must beat colocated
goodput per GPU at scale by this fraction to be recommended: below it the simpler
deployment (no KV handoff) wins the tie."""


@dataclass(frozen=True)
class Sized:
    """The smallest deployment found that serves the rate within the SLO."""

    config: SimConfig
    attainment: float
    """Fraction of requests meeting both targets at the rate."""
    ttft_p90: float
    tpot_p90: float
    tried: int
    """Configurations simulated to find it."""

    @property
    def gpus(self) -> int:
        return self.config.gpus

    @property
    def label(self) -> str:
        return self.config.label()

    def tensor_parallel(self, role: Role) -> int:
        return self.config.pools[role].tp


def tp_options(
    model: ModelSpec, gpu: GpuSpec, budget: int, fixed: int | None = None
) -> tuple[int, ...]:
    """Tensor-parallel sizes to try for one pool: ``fixed`` alone when given, else the
    powers of two from the smallest that holds the weights up to :data:`MAX_TP` (and the
    budget). Raises :class:`ConfigError` when not even the smallest fits the budget."""
    if fixed is not None:
        if fixed < 1:
            raise ConfigError(f"tensor parallelism must be at least 1 (got {fixed})")
        return (fixed,)
    least = pick_tp(model, gpu, MAX_TP)
    if least > budget:
        raise ConfigError(
            f"{model.name} needs {least} x {gpu.name} per worker: give --gpus {least} or more"
        )
    out = []
    tp = least
    while tp <= min(MAX_TP, budget):
        out.append(tp)
        tp *= 2
    return tuple(out)


def colocated_candidates(
    model: ModelSpec,
    gpu: GpuSpec,
    tps: Sequence[int],
    chunk_sizes: Sequence[int],
    budget: int,
) -> list[SimConfig]:
    """Every colocated deployment within ``budget`` GPUs: workers of each TP, each chunk."""
    out = []
    for tp in tps:
        base = roofline_config(model, Mode.COLOCATED, gpu, tp=tp)
        for n in range(1, budget // tp + 1):
            out += [replace(base.with_replicas(both=n), chunk_size=c) for c in chunk_sizes]
    return out


def disaggregated_candidates(
    model: ModelSpec,
    prefill_gpu: GpuSpec,
    decode_gpu: GpuSpec,
    link: LinkSpec,
    prefill_tps: Sequence[int],
    decode_tps: Sequence[int],
    budget: int,
    *,
    layerwise: bool = True,
) -> list[SimConfig]:
    """Every split within ``budget`` GPUs: prefill and decode workers of each TP pair."""
    out = []
    for pt, dt in itertools.product(prefill_tps, decode_tps):
        base = roofline_config(
            model,
            Mode.DISAGGREGATED,
            prefill_gpu,
            link=link,
            decode_gpu=decode_gpu,
            prefill_tp=pt,
            decode_tp=dt,
            layerwise=layerwise,
        )
        for p in range(1, (budget - dt) // pt + 1):
            for d in range(1, (budget - p * pt) // dt + 1):
                out.append(base.with_replicas(prefill=p, decode=d))
    return out


def fewest_gpus(
    configs: Iterable[SimConfig],
    workload: Workload,
    slo: Slo,
    *,
    target: float = TARGET_ATTAINMENT,
) -> Sized | None:
    """The deployment of fewest GPUs among ``configs`` that attains ``target`` at the
    workload's own rate (among those of that count, the one with the highest
    attainment); ``None`` when none does. Configurations whose prompt throughput cannot
    keep up with the rate are passed over without simulating."""
    rate = workload.rate
    if not (math.isfinite(rate) and rate > 0):
        return None
    room = OVERLOAD * (10 if workload.hash_ids is not None else 1)
    tried = 0
    ordered = sorted(configs, key=lambda c: c.gpus)
    for _, group in itertools.groupby(ordered, key=lambda c: c.gpus):
        best: Sized | None = None
        for config in group:
            if rate > room * prefill_bound(config, workload):
                continue
            tried += 1
            res = simulate(config, workload, rate, slo)
            attained = res.attainment(slo)
            if attained < target or (best is not None and attained <= best.attainment):
                continue
            done = res.n_finished > 0
            best = Sized(
                config=config,
                attainment=attained,
                ttft_p90=float(np.percentile(res.ttft, 90)) if done else math.inf,
                tpot_p90=float(np.percentile(res.tpot, 90)) if done else math.inf,
                tried=tried,
            )
        if best is not None:
            return replace(best, tried=tried)
    return None


class Basis(StrEnum):
    """What a recommendation rests on."""

    FEWER_GPUS = "fewer GPUs at the rate"
    TIE = "as few GPUs either way at the rate: the simpler deployment"
    ONLY_ONE = "only one way serves the rate within the GPU budget"
    AT_SCALE = "neither way serves the rate within the GPU budget: goodput per GPU at scale"
    NEITHER = "neither way meets the SLO at any rate tried"


@dataclass(frozen=True)
class Decision:
    mode: Mode
    basis: Basis


def decide(
    colocated_gpus: int | None,
    disaggregated_gpus: int | None,
    colocated_per_gpu: float,
    disaggregated_per_gpu: float,
    *,
    margin: float = WIN_MARGIN,
) -> Decision:
    """Colocate or disaggregate, by what the user's own rate costs.

    ``*_gpus``: the fewest GPUs that serve the rate each way (``None``: not within the
    budget); ``*_per_gpu``: goodput per GPU at scale, each way. Fewer GPUs at the rate
    wins; as many colocates (no KV handoff to run); when only one way serves the rate it
    wins; when neither does, goodput per GPU at scale decides (disaggregation needs a
    ``margin`` lead) and when neither meets the SLO at all, colocated stays the default.
    """
    if colocated_gpus is not None and disaggregated_gpus is not None:
        if disaggregated_gpus < colocated_gpus:
            return Decision(Mode.DISAGGREGATED, Basis.FEWER_GPUS)
        if colocated_gpus < disaggregated_gpus:
            return Decision(Mode.COLOCATED, Basis.FEWER_GPUS)
        return Decision(Mode.COLOCATED, Basis.TIE)
    if colocated_gpus is not None:
        return Decision(Mode.COLOCATED, Basis.ONLY_ONE)
    if disaggregated_gpus is not None:
        return Decision(Mode.DISAGGREGATED, Basis.ONLY_ONE)
    if colocated_per_gpu <= 0 and disaggregated_per_gpu <= 0:
        return Decision(Mode.COLOCATED, Basis.NEITHER)
    if colocated_per_gpu <= 0 or disaggregated_per_gpu > colocated_per_gpu * (1 + margin):
        return Decision(Mode.DISAGGREGATED, Basis.AT_SCALE)
    return Decision(Mode.COLOCATED, Basis.AT_SCALE)
