"""Should this model, on these GPUs and this link, under this traffic, disaggregate?

:func:`advise` decides by what the workload's own rate costs: the fewest GPUs that
serve it within the SLO colocated (chunk size searched) and disaggregated
(prefill:decode split and each pool's tensor parallelism searched), by :mod:`.sizing`.
Beside it, goodput per GPU at
scale (the best of each way on the whole GPU budget, at the tensor parallelism chosen)
says what changes as the traffic grows, and the loser's limits explain it: TTFT or TPOT
misses, the KV handoff, idle prefill GPUs. :meth:`Advice.inference_service` is the
deployment as an InferenceService.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitserve_operator.sim.config import Mode, Role, SimConfig, Slo, roofline_config
from splitserve_operator.sim.cost import exposed_transfer_s
from splitserve_operator.sim.goodput import (
    MAX_TILES,
    QUEUE_HORIZON,
    GoodputResult,
    SplitSearch,
    best_colocated,
    best_disaggregated,
)
from splitserve_operator.sim.hardware import GpuSpec, LinkSpec
from splitserve_operator.sim.model_spec import ModelSpec
from splitserve_operator.sim.simulator import Simulator
from splitserve_operator.sim.sizing import (
    Basis,
    Decision,
    Sized,
    colocated_candidates,
    decide,
    disaggregated_candidates,
    fewest_gpus,
    tp_options,
)
from splitserve_operator.sim.workload import Workload

CHUNK_SIZES = (128, 256, 512, 1024, 2048)
"""Colocated chunk sizes tried; the best one is reported."""

WORKER_IMAGE = "splitserve/worker:0.1.0"
"""The image the printed InferenceService names (the chart's examples use it too)."""


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
    """The GPU budget: the most the rate is sized with, and what goodput at scale uses."""
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
    colocated_at_rate: Sized | None
    """The fewest GPUs that serve the workload's rate colocated (``None``: not within
    ``gpus``)."""
    disaggregated_at_rate: Sized | None
    colocated: GoodputResult
    """Goodput at scale: the best colocated deployment on ``gpus`` GPUs."""
    disaggregated: GoodputResult
    colocated_search: SplitSearch
    disaggregated_search: SplitSearch
    colocated_why: Diagnosis
    disaggregated_why: Diagnosis
    decision: Decision
    reason: str

    @property
    def recommendation(self) -> Mode:
        return self.decision.mode

    @property
    def deployment(self) -> SimConfig:
        """What is recommended: the deployment that serves the rate on the fewest GPUs,
        or, where none does within the budget, the best at scale."""
        if self.recommendation is Mode.COLOCATED:
            sized, scale = self.colocated_at_rate, self.colocated
        else:
            sized, scale = self.disaggregated_at_rate, self.disaggregated
        return sized.config if sized is not None else scale.config

    @property
    def ratio(self) -> tuple[int, int]:
        """The recommended prefill:decode workers (disaggregated)."""
        r = self.deployment.replicas
        return r.get(Role.PREFILL, 0), r.get(Role.DECODE, 0)

    @property
    def tensor_parallel(self) -> dict[str, int]:
        """Each pool's recommended tensor-parallel size (colocated: the decode pool's
        workers do both)."""
        pools = self.deployment.pools
        if Role.BOTH in pools:
            return {"prefill": pools[Role.BOTH].tp, "decode": pools[Role.BOTH].tp}
        return {"prefill": pools[Role.PREFILL].tp, "decode": pools[Role.DECODE].tp}

    def inference_service(self) -> dict[str, Any]:
        """The recommendation as an ``InferenceService`` (``splitserve.io/v1alpha1``):
        each pool's replicas, GPUs and ``tensorParallelSize``, the SLO; colocated is a
        decode pool that prefills its own prompts (no prefill pool, the router's
        ``disaggregation: never``). Model source, image and resources are the user's."""
        d = self.deployment
        tp = self.tensor_parallel
        if d.mode is Mode.COLOCATED:
            prefill = {"replicas": 0, "gpus": tp["prefill"], "tensorParallelSize": tp["prefill"]}
            decode_n = d.replicas[Role.BOTH]
            router: dict[str, Any] = {"settings": {"disaggregation": "never"}}
        else:
            prefill = {
                "replicas": d.replicas[Role.PREFILL],
                "gpus": tp["prefill"],
                "tensorParallelSize": tp["prefill"],
            }
            decode_n = d.replicas[Role.DECODE]
            router = {}
        spec: dict[str, Any] = {
            "model": {"name": self.model.name},
            "image": WORKER_IMAGE,
            "prefill": prefill,
            "decode": {
                "replicas": decode_n,
                "gpus": tp["decode"],
                "tensorParallelSize": tp["decode"],
            },
            **({"router": router} if router else {}),
            "slo": {"ttft": _duration(self.slo.ttft_s), "tpot": _duration(self.slo.tpot_s)},
        }
        return {
            "apiVersion": "splitserve.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": _service_name(self.model.name)},
            "spec": spec,
        }

    def as_dict(self) -> dict[str, Any]:
        def at_rate(sized: Sized | None) -> dict[str, Any] | None:
            if sized is None:
                return None
            pools = sized.config.pools
            return {
                "config": sized.label,
                "gpus": sized.gpus,
                "tensor_parallel": {str(role): pool.tp for role, pool in pools.items()},
                "attainment": sized.attainment,
                "ttft_p90_s": sized.ttft_p90,
                "tpot_p90_s": sized.tpot_p90,
                "configurations_simulated": sized.tried,
            }

        def gp(g: GoodputResult, why: Diagnosis, sized: Sized | None) -> dict[str, Any]:
            return {
                "at_rate": at_rate(sized),
                "gpus_needed_for_workload_rate": sized.gpus if sized else None,
                "config": g.label,
                "gpus": g.gpus,
                "goodput_rps": g.rate,
                "goodput_rps_per_gpu": g.per_gpu,
                "attainment_at_goodput": g.attainment,
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
            "colocated": gp(self.colocated, self.colocated_why, self.colocated_at_rate),
            "disaggregated": gp(
                self.disaggregated, self.disaggregated_why, self.disaggregated_at_rate
            ),
            "recommendation": str(self.recommendation),
            "decided_by": str(self.decision.basis),
            "recommended_config": self.deployment.label(),
            "recommended_gpus": self.deployment.gpus,
            "prefill_decode_ratio": [p, d] if self.recommendation is Mode.DISAGGREGATED else None,
            "tensor_parallel": self.tensor_parallel,
            "inference_service": self.inference_service(),
            "reason": self.reason,
        }

    def render(self) -> str:
        m = self.model
        p, d = self.ratio
        rate = f"{self.workload_rate:.3g} req/s"
        lines = [
            f"model        {m.describe()}",
            f"hardware     prefill {self.prefill_gpu.description}, decode "
            f"{self.decode_gpu.description}; up to {self.gpus} GPUs; KV link {self.link.name} "
            f"({self.link.description}, {self.link.bandwidth / 1e9:g} GB/s one way)",
            f"workload     {self.workload_name}, {rate}; SLO TTFT "
            f"{_ms(self.slo.ttft_s)}, TPOT {_ms(self.slo.tpot_s)} (>= 90 % of requests meet both)",
            "",
            f"KV cache     {self.kv_bytes_per_token:,} bytes per token "
            f"({self.kv_bytes_per_token / 1024:.1f} KiB)",
            f"typical      {self.typical_prompt:,}-token prompt: KV "
            f"{_bytes(self.typical_kv_bytes)}, raw transfer {_ms(self.raw_transfer_s)} "
            f"on {self.link.name}; prefill {_ms(self.typical_prefill_s)}; exposed after prefill "
            f"{_ms(self.exposed_transfer_s)}",
            "",
            f"at {rate}   fewest GPUs that meet the SLO (split and tensor parallelism searched)",
        ]
        for name, sized in (
            ("colocated", self.colocated_at_rate),
            ("disaggregated", self.disaggregated_at_rate),
        ):
            if sized is None:
                lines.append(f"  {name:14s} not within {self.gpus} GPUs")
            else:
                lines.append(
                    f"  {name:14s} {sized.gpus:3d} GPU{'s' if sized.gpus != 1 else ' '}  "
                    f"{sized.label} (p90 TTFT {_ms(sized.ttft_p90)}, TPOT {_ms(sized.tpot_p90)}; "
                    f"{sized.attainment:.0%} meet both)"
                )
        lines += [
            "",
            f"at scale     goodput per GPU on {self.gpus} GPUs (highest rate with >= 90 % SLO "
            "attainment, / GPUs)",
        ]
        for name, g in (("colocated", self.colocated), ("disaggregated", self.disaggregated)):
            lines.append(
                f"  {name:14s} {g.per_gpu:8.3f} req/s/GPU  ({g.rate:.3g} req/s on {g.gpus} GPUs: "
                f"{g.label})"
            )
        lines.append("")
        tp = self.tensor_parallel
        gpus = self.deployment.gpus
        if self.recommendation is Mode.DISAGGREGATED:
            lines.append(
                f"recommendation: DISAGGREGATE on {gpus} GPUs, prefill:decode = {p}:{d}, "
                f"tensor parallelism prefill {tp['prefill']}, decode {tp['decode']}"
            )
        else:
            n = self.deployment.replicas[Role.BOTH]
            lines.append(
                f"recommendation: COLOCATE on {gpus} GPU{'s' if gpus != 1 else ''} "
                f"({n} worker{'s' if n != 1 else ''} of tensor parallelism {tp['decode']}, "
                "chunked prefill on shared GPUs)"
            )
        lines.append(f"why: {self.reason}")
        return "\n".join(lines)


def _ms(s: float) -> str:
    if not math.isfinite(s):
        return "never"
    return f"{s * 1000:.3g} ms" if s < 1 else f"{s:.3g} s"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _duration(s: float) -> str:
    """Seconds as the CRD's duration (``2s``, ``100ms``)."""
    return f"{s * 1000:g}ms" if s < 1 else f"{s:g}s"


def _service_name(model: str) -> str:
    """An InferenceService name from a model's: a DNS label of at most 40 characters."""
    name = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:40].rstrip("-")
    return name if name[:1].isalpha() else f"m-{name}".rstrip("-")


def diagnose(config: SimConfig, workload: Workload, slo: Slo, rate: float) -> Diagnosis:
    """Run at ``rate`` and say which target is missed and how busy each pool is (the
    workload tiled as a goodput probe tiles it: a queue must have time to build)."""
    w = workload.at_rate(rate)
    if len(w):
        w = w.tiled(min(MAX_TILES, math.ceil(rate * QUEUE_HORIZON * slo.ttft_s / len(w))))
    sim = Simulator(config, w)
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
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    layerwise: bool = True,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    max_requests: int = 1000,
) -> Advice:
    """The fewest GPUs serving the workload's rate each way, goodput per GPU at scale on
    ``gpus`` GPUs, and a verdict (:func:`~.sizing.decide`).

    ``prefill_gpu`` also runs the colocated deployment. ``tp`` fixes every pool's tensor
    parallelism, ``prefill_tp`` / ``decode_tp`` one pool's (``None``: each pool's
    searched, from the smallest that holds the weights; :class:`~.config.ConfigError`
    says what to give when not even that fits the budget). Only the first
    ``max_requests`` requests of
    ``workload`` are simulated per probe.
    """
    dg = decode_gpu or prefill_gpu
    w = workload.head(max_requests) if len(workload) > max_requests else workload
    pre_tps = tp_options(model, prefill_gpu, gpus, prefill_tp or tp)
    dec_tps = tp_options(model, dg, gpus, decode_tp or tp)
    col_tps = tp_options(model, prefill_gpu, gpus, tp)
    col_sized = fewest_gpus(
        colocated_candidates(model, prefill_gpu, col_tps, chunk_sizes, gpus), w, slo
    )
    dis_sized = fewest_gpus(
        disaggregated_candidates(
            model, prefill_gpu, dg, link, pre_tps, dec_tps, gpus, layerwise=layerwise
        ),
        w,
        slo,
    )

    # at scale, each way at the tensor parallelism that served the rate (else the least)
    col_tp = col_sized.tensor_parallel(Role.BOTH) if col_sized else col_tps[0]
    pre_tp = dis_sized.tensor_parallel(Role.PREFILL) if dis_sized else pre_tps[0]
    dec_tp = dis_sized.tensor_parallel(Role.DECODE) if dis_sized else dec_tps[0]
    col_base = roofline_config(model, Mode.COLOCATED, prefill_gpu, tp=col_tp)
    dis_base = roofline_config(
        model, Mode.DISAGGREGATED, prefill_gpu, link=link, decode_gpu=dg, prefill_tp=pre_tp,
        decode_tp=dec_tp, layerwise=layerwise,
    )  # fmt: skip
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
    decision = decide(
        col_sized.gpus if col_sized else None,
        dis_sized.gpus if dis_sized else None,
        cb.per_gpu,
        db.per_gpu,
    )
    rate = workload.rate if math.isfinite(workload.rate) else 0.0
    handoff = (
        f"the KV handoff of a typical {typical:,}-token prompt costs {_ms(raw)} raw on "
        f"{link.name} and {_ms(exposed)} after prefill as deployed"
    )
    reason = (
        _at_rate_reason(decision, col_sized, dis_sized, rate, gpus)
        + " "
        + _scale_reason(cb, db, col_why, dis_why, slo, handoff)
    )
    return Advice(
        model=model,
        prefill_gpu=prefill_gpu,
        decode_gpu=dg,
        link=link,
        slo=slo,
        gpus=gpus,
        workload_name=workload.name,
        workload_rate=rate,
        typical_prompt=typical,
        kv_bytes_per_token=kv_tok,
        typical_kv_bytes=kv,
        raw_transfer_s=raw,
        exposed_transfer_s=exposed,
        typical_prefill_s=prefill_s,
        colocated_at_rate=col_sized,
        disaggregated_at_rate=dis_sized,
        colocated=cb,
        disaggregated=db,
        colocated_search=col,
        disaggregated_search=dis,
        colocated_why=col_why,
        disaggregated_why=dis_why,
        decision=decision,
        reason=reason,
    )


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def _at_rate_reason(
    decision: Decision, col: Sized | None, dis: Sized | None, rate: float, budget: int
) -> str:
    """What the rate costs each way, and why that decides."""
    at = f"{rate:.3g} req/s"
    if decision.basis is Basis.FEWER_GPUS or decision.basis is Basis.TIE:
        assert col is not None and dis is not None
        costs = (
            f"at {at} colocated needs {_gpus(col.gpus)} ({col.label}) and disaggregated "
            f"{_gpus(dis.gpus)} ({dis.label})"
        )
        if decision.basis is Basis.TIE:
            return f"{costs}: as many either way, so the simpler deployment (no KV handoff) wins."
        winner = "colocated" if decision.mode is Mode.COLOCATED else "disaggregated"
        return f"{costs}: {winner} serves your rate on fewer GPUs."
    if decision.basis is Basis.ONLY_ONE:
        found = col if col is not None else dis
        assert found is not None
        winner = "colocated" if col is not None else "disaggregated"
        loser = "disaggregated" if col is not None else "colocated"
        return (
            f"at {at} {winner} meets the SLO on {_gpus(found.gpus)} ({found.label}); "
            f"{loser} does not within {_gpus(budget)}."
        )
    if decision.basis is Basis.AT_SCALE:
        return (
            f"neither way meets the SLO at {at} within {_gpus(budget)} (raise --gpus to size "
            "it), so goodput per GPU at scale decides."
        )
    return "neither way meets the SLO at any rate tried."


def _scale_reason(
    col: GoodputResult,
    dis: GoodputResult,
    col_why: Diagnosis,
    dis_why: Diagnosis,
    slo: Slo,
    handoff: str,
) -> str:
    """What goodput per GPU at scale says, and what limits each way there."""
    if col.per_gpu <= 0 and dis.per_gpu <= 0:
        return (
            "Even an idle deployment misses the SLO "
            f"(p90 TTFT {_ms(col_why.ttft_p90)} / TPOT {_ms(col_why.tpot_p90)} colocated); "
            "relax the targets, use faster GPUs or more tensor parallelism."
        )
    if col.per_gpu <= 0:
        return (
            f"At scale only disaggregated meets the SLO (colocated is limited by "
            f"{col_why.limited_by} at any rate tried); {handoff}."
        )
    gain = dis.per_gpu / col.per_gpu - 1
    if gain > 0:
        col_lim = col_why.limited_by
        what = (
            "prefill chunks sharing each step with decode stretch the time between tokens"
            if col_lim == "TPOT"
            else "prompts queue behind each other's chunks and behind decode"
        )
        return (
            f"At scale disaggregated serves {_times(gain)} more per GPU: colocated is limited "
            f"by {col_lim} ({what}: just above its goodput {col_why.miss_tpot:.0%} of "
            f"requests miss TPOT {_ms(slo.tpot_s)} and {col_why.miss_ttft:.0%} miss TTFT "
            f"{_ms(slo.ttft_s)}), while separate pools keep decode steps free of prefill; "
            f"{handoff}."
        )
    busy = dis_why.busy
    idle_pool = min(busy, key=lambda k: busy[k]) if busy else "prefill"
    lead = (
        f"colocated serves {_times(-gain / (1 + gain))} more per GPU"
        if gain < 0
        else ("the two serve as much per GPU")
    )
    return (
        f"At scale {lead}: with chunked prefill the decode steps barely slow down at these "
        f"prompt lengths and targets (colocated is limited by {col_why.limited_by}), while a "
        f"split deployment leaves its {idle_pool} pool partly idle (busy "
        f"{busy.get(idle_pool, 0):.0%} just above its goodput) and pays the handoff: {handoff}."
    )


def _times(gain: float) -> str:
    return f"{gain:.0%}" if gain < 1 else f"{1 + gain:.1f}x"


def workload_for_advice(
    rate: float, prompt: int, output: int, n: int = 1000, seed: int = 0
) -> Workload:
    """The Poisson workload behind ``--rate --prompt-len --output-len``: its arrivals
    scaled to a mean of exactly ``rate`` (a draw of ``n`` alone lands a few percent off),
    so the rate sized is the one asked about."""
    from splitserve_operator.sim.workload import poisson

    name = f"Poisson, prompt {prompt}, output {output}"
    return poisson(rate, n, prompt, output, seed=seed, name=name).at_rate(rate)


__all__ = ["Advice", "Diagnosis", "advise", "diagnose", "workload_for_advice"]
