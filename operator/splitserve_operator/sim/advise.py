"""Should this model, on these GPUs and this link, under this traffic, disaggregate?

:func:`advise` compares the goodput per GPU of the best colocated
configuration (chunk size searched) with the best disaggregated one
(prefill:decode split searched) for a GPU budget, and explains the winner with
what limits the loser: TTFT or TPOT misses, the KV handoff, idle prefill GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitserve_operator.sim.config import Mode, Role, SimConfig, Slo, roofline_config
from splitserve_operator.sim.cost import exposed_transfer_s
from splitserve_operator.sim.goodput import (
    GoodputResult,
    SplitSearch,
    best_colocated,
    best_disaggregated,
)
from splitserve_operator.sim.hardware import GpuSpec, LinkSpec
from splitserve_operator.sim.model_spec import ModelSpec
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.workload import Workload

WIN_MARGIN = 0.05
"""Disaggregation must beat colocated goodput per GPU by this fraction to be
recommended: below it the simpler deployment (no KV handoff) wins the tie."""

CHUNK_SIZES = (128, 256, 512, 1024, 2048)
"""Colocated chunk sizes tried; the best one is reported."""


@dataclass(frozen=True)
class Diagnosis:
    """Why a configuration stops at its goodput: measured just above it."""

    rate: float
    miss_ttft: float
    """Fraction of requests over the TTFT target."""
    miss_tpot: float
    ttft_p90: float
    tpot_p90: float
    busy: dict[str, float] = field(default_factory=dict)
    """Busy fraction of each pool."""

    @property
    def limited_by(self) -> str:
        return "TPOT" if self.miss_tpot >= self.miss_ttft else "TTFT"


@dataclass(frozen=True)
class Advice:
    model: ModelSpec
    prefill_gpu: GpuSpec
    decode_gpu: GpuSpec
    link: LinkSpec
    slo: Slo
    gpus: int
    workload_name: str
    workload_rate: float
    typical_prompt: int
    kv_bytes_per_token: int
    typical_kv_bytes: int
    raw_transfer_s: float
    """Typical prompt's KV over one link, nothing overlapped (the seed article's figure)."""
    exposed_transfer_s: float
    """What the deployment's transfer adds after prefill, on an idle link."""
    typical_prefill_s: float
    colocated: GoodputResult
    disaggregated: GoodputResult
    colocated_search: SplitSearch
    disaggregated_search: SplitSearch
    colocated_why: Diagnosis
    disaggregated_why: Diagnosis
    recommendation: Mode
    reason: str

    @property
    def ratio(self) -> tuple[int, int]:
        r = self.disaggregated.config.replicas
        return r[Role.PREFILL], r[Role.DECODE]

    def gpus_needed(self, g: GoodputResult) -> int | None:
        """GPUs for the workload's own rate, scaling the goodput per GPU linearly
        (at least one instance of each pool)."""
        if g.per_gpu <= 0:
            return None
        floor = sum(p.tp for p in g.config.pools.values())
        return max(floor, math.ceil(self.workload_rate / g.per_gpu))

    def as_dict(self) -> dict[str, Any]:
        def gp(g: GoodputResult, why: Diagnosis) -> dict[str, Any]:
            return {
                "config": g.label,
                "gpus": g.gpus,
                "goodput_rps": g.rate,
                "goodput_rps_per_gpu": g.per_gpu,
                "attainment_at_goodput": g.attainment,
                "gpus_needed_for_workload_rate": self.gpus_needed(g),
                "limited_by": why.limited_by,
                "just_above_goodput": {
                    "rate": why.rate,
                    "miss_ttft": why.miss_ttft,
                    "miss_tpot": why.miss_tpot,
                    "ttft_p90_s": why.ttft_p90,
                    "tpot_p90_s": why.tpot_p90,
                    "busy": why.busy,
                },
                "searched": [{"config": r.label, "goodput_rps_per_gpu": r.per_gpu} for r in
                             (self.colocated_search if g is self.colocated else
                              self.disaggregated_search).results],
            }  # fmt: skip

        p, d = self.ratio
        return {
            "model": self.model.name,
            "params_b": self.model.total_params / 1e9,
            "prefill_gpu": self.prefill_gpu.name,
            "decode_gpu": self.decode_gpu.name,
            "link": self.link.name,
            "link_bandwidth_gbps": self.link.bandwidth / 1e9,
            "gpus": self.gpus,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
            "workload": self.workload_name,
            "workload_rate_rps": self.workload_rate,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "typical_prompt_tokens": self.typical_prompt,
            "typical_kv_bytes": self.typical_kv_bytes,
            "raw_transfer_s": self.raw_transfer_s,
            "exposed_transfer_s": self.exposed_transfer_s,
            "typical_prefill_s": self.typical_prefill_s,
            "colocated": gp(self.colocated, self.colocated_why),
            "disaggregated": gp(self.disaggregated, self.disaggregated_why),
            "recommendation": str(self.recommendation),
            "prefill_decode_ratio": [p, d] if self.recommendation is Mode.DISAGGREGATED else None,
            "reason": self.reason,
        }

    def render(self) -> str:
        m = self.model
        p, d = self.ratio
        lines = [
            f"model        {m.describe()}",
            f"hardware     prefill {self.prefill_gpu.description}, decode "
            f"{self.decode_gpu.description}; {self.gpus} GPUs; KV link {self.link.name} "
            f"({self.link.description}, {self.link.bandwidth / 1e9:g} GB/s one way)",
            f"workload     {self.workload_name}, {self.workload_rate:.3g} req/s; SLO TTFT "
            f"{_ms(self.slo.ttft_s)}, TPOT {_ms(self.slo.tpot_s)} (>= 90 % of requests meet both)",
            "",
            f"KV cache     {self.kv_bytes_per_token:,} bytes per token "
            f"({self.kv_bytes_per_token / 1024:.1f} KiB)",
            f"typical      {self.typical_prompt:,}-token prompt: KV "
            f"{_bytes(self.typical_kv_bytes)}, raw transfer {_ms(self.raw_transfer_s)} "
            f"on {self.link.name}; prefill {_ms(self.typical_prefill_s)}; exposed after prefill "
            f"{_ms(self.exposed_transfer_s)}",
            "",
            "goodput per GPU (highest rate with >= 90 % SLO attainment, / GPUs)",
        ]
        for name, g in (("colocated", self.colocated), ("disaggregated", self.disaggregated)):
            need = self.gpus_needed(g)
            need_s = (
                f", ~{need} GPU{'s' if need != 1 else ''} for {self.workload_rate:.3g} req/s"
                if need
                else ""
            )
            lines.append(
                f"  {name:14s} {g.per_gpu:8.3f} req/s/GPU  ({g.rate:.3g} req/s on {g.gpus} GPUs: "
                f"{g.label}{need_s})"
            )
        lines.append("")
        if self.recommendation is Mode.DISAGGREGATED:
            lines.append(f"recommendation: DISAGGREGATE, prefill:decode = {p}:{d}")
        else:
            lines.append("recommendation: COLOCATE (chunked prefill on shared GPUs)")
        lines.append(f"why: {self.reason}")
        return "\n".join(lines)


def _ms(s: float) -> str:
    return f"{s * 1000:.3g} ms" if s < 1 else f"{s:.3g} s"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def diagnose(config: SimConfig, workload: Workload, slo: Slo, rate: float) -> Diagnosis:
    """Run at ``rate`` and say which target is missed and how busy each pool is."""
    sim = Simulator(config, workload.at_rate(rate))
    res = sim.run()
    window = sim.observe()
    n = max(1, res.n_requests)
    return Diagnosis(
        rate=rate,
        miss_ttft=float(np.count_nonzero(res.ttft > slo.ttft_s)) / n,
        miss_tpot=float(np.count_nonzero(res.tpot > slo.tpot_s)) / n,
        ttft_p90=float(np.percentile(res.ttft, 90)) if res.n_finished else math.inf,
        tpot_p90=float(np.percentile(res.tpot, 90)) if res.n_finished else math.inf,
        busy={k: v.busy_fraction for k, v in window.pools.items()},
    )


def advise(
    model: ModelSpec,
    prefill_gpu: GpuSpec,
    link: LinkSpec,
    slo: Slo,
    workload: Workload,
    *,
    decode_gpu: GpuSpec | None = None,
    gpus: int = 8,
    tp: int | None = None,
    layerwise: bool = True,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    max_requests: int = 1000,
) -> Advice:
    """Goodput per GPU of both architectures within ``gpus`` GPUs, and a verdict.

    ``prefill_gpu`` also runs the colocated deployment. Only the first
    ``max_requests`` requests of ``workload`` are simulated per probe.
    """
    dg = decode_gpu or prefill_gpu
    w = workload.head(max_requests) if len(workload) > max_requests else workload
    col_base = roofline_config(model, Mode.COLOCATED, prefill_gpu, tp=tp)
    dis_base = roofline_config(
        model, Mode.DISAGGREGATED, prefill_gpu, link=link, decode_gpu=dg, tp=tp, layerwise=layerwise
    )
    col = best_colocated(col_base, w, slo, gpus, chunk_sizes)
    dis = best_disaggregated(dis_base, w, slo, gpus)
    cb, db = col.best, dis.best

    typical = max(1, int(np.median(workload.prompt)))
    kv_tok = model.kv_bytes_per_token
    kv = typical * kv_tok
    raw = link.transfer_time(kv)
    pre_pool = dis_base.pools[Role.PREFILL]
    prefill_s = pre_pool.cost.step_time(typical, typical * (typical + 1) / 2, 1, 0, 0)
    deployed = link.latency_s + dis_base.handoff_s(typical)
    exposed = exposed_transfer_s(deployed, prefill_s, model.layers, layerwise)

    col_why = diagnose(cb.config, w, slo, max(cb.rate, 1e-3) * 1.15)
    dis_why = diagnose(db.config, w, slo, max(db.rate, 1e-3) * 1.15)
    rec, reason = _verdict(cb, db, col_why, dis_why, slo, exposed, raw, link, typical)
    return Advice(
        model=model,
        prefill_gpu=prefill_gpu,
        decode_gpu=dg,
        link=link,
        slo=slo,
        gpus=gpus,
        workload_name=workload.name,
        workload_rate=workload.rate if math.isfinite(workload.rate) else 0.0,
        typical_prompt=typical,
        kv_bytes_per_token=kv_tok,
        typical_kv_bytes=kv,
        raw_transfer_s=raw,
        exposed_transfer_s=exposed,
        typical_prefill_s=prefill_s,
        colocated=cb,
        disaggregated=db,
        colocated_search=col,
        disaggregated_search=dis,
        colocated_why=col_why,
        disaggregated_why=dis_why,
        recommendation=rec,
        reason=reason,
    )


def _verdict(
    col: GoodputResult,
    dis: GoodputResult,
    col_why: Diagnosis,
    dis_why: Diagnosis,
    slo: Slo,
    exposed: float,
    raw: float,
    link: LinkSpec,
    typical: int,
) -> tuple[Mode, str]:
    if col.per_gpu <= 0 and dis.per_gpu <= 0:
        return Mode.COLOCATED, (
            "neither architecture meets the SLO at any rate tried: even an idle deployment "
            f"misses it (p90 TTFT {_ms(col_why.ttft_p90)} / TPOT {_ms(col_why.tpot_p90)} "
            "colocated); relax the targets, use faster GPUs or more tensor parallelism"
        )
    handoff = (
        f"the KV handoff of a typical {typical:,}-token prompt costs {_ms(raw)} raw on "
        f"{link.name} and {_ms(exposed)} after prefill as deployed"
    )
    gain = dis.per_gpu / col.per_gpu - 1 if col.per_gpu > 0 else math.inf
    if gain > WIN_MARGIN:
        col_lim = col_why.limited_by
        what = (
            "prefill chunks sharing each step with decode stretch the time between tokens"
            if col_lim == "TPOT"
            else "prompts queue behind each other's chunks and behind decode"
        )
        return Mode.DISAGGREGATED, (
            f"disaggregated serves {_times(gain)} more per GPU. Colocated is limited by "
            f"{col_lim} ({what}: just above its goodput {col_why.miss_tpot:.0%} of requests "
            f"miss TPOT {_ms(slo.tpot_s)} and {col_why.miss_ttft:.0%} miss TTFT "
            f"{_ms(slo.ttft_s)}). Separate pools keep decode steps free of prefill; "
            f"{handoff}, small against the TTFT target."
        )
    busy = dis_why.busy
    idle_pool = min(busy, key=lambda k: busy[k]) if busy else "prefill"
    if gain < -WIN_MARGIN:
        lead = f"colocated serves {_times(-gain / (1 + gain))} more per GPU"
    else:
        lead = (
            f"the two are within {WIN_MARGIN:.0%} of each other per GPU, so the simpler "
            "deployment wins"
        )
    return Mode.COLOCATED, (
        f"{lead}. With chunked prefill the decode steps barely slow down at these prompt "
        f"lengths and targets (colocated is limited by {col_why.limited_by}), while a split "
        f"deployment leaves its {idle_pool} pool partly idle (busy "
        f"{busy.get(idle_pool, 0):.0%} just above its goodput) and pays the handoff: {handoff}."
    )


def _times(gain: float) -> str:
    return f"{gain:.0%}" if gain < 1 else f"{1 + gain:.1f}x"


def workload_for_advice(
    rate: float, prompt: int, output: int, n: int = 1000, seed: int = 0
) -> Workload:
    """The Poisson workload behind ``--rate --prompt-len --output-len``."""
    from splitserve_operator.sim.workload import poisson

    return poisson(
        rate, n, prompt, output, seed=seed, name=f"Poisson, prompt {prompt}, output {output}"
    )


__all__ = ["Advice", "Diagnosis", "advise", "diagnose", "workload_for_advice"]
