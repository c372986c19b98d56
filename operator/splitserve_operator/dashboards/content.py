"""splitserve's four dashboards: service overview and pools here, KV transfer and
planner in :mod:`.internals`; :data:`DASHBOARDS` lists all four.

Every query is built from the metric names in :mod:`splitserve.metric_names`
and the same series selector the planner uses
(:data:`splitserve_operator.api.series.DEFAULT_SELECTOR`), so a dashboard shows
what the planner sees. A test runs each query against a live Prometheus fed by
real workers.
"""

from __future__ import annotations

import splitserve.metric_names as n

from splitserve_operator.dashboards.grafana import Dashboard, Panel, Row, Target
from splitserve_operator.dashboards.internals import kv_transfer, planner, replicas_panel
from splitserve_operator.dashboards.queries import (
    BY_ROLE,
    QUANTILES,
    SLO_VARIABLES,
    VARIABLES,
    WORKERS,
    attainment,
    gauge,
    quantile,
    rate,
    selector,
    slo_line,
)


def _latency_panel(title: str, spec: n.MetricSpec, objective: str) -> Panel:
    return Panel(
        title,
        (
            *(Target(quantile(spec, q), f"p{q * 100:g}") for q in QUANTILES),
            slo_line(objective),
        ),
        unit="s",
        description=f"{spec.help} Percentiles over the rate window, with the SLO.",
    )


def overview() -> Dashboard:
    ttft_ok = attainment(n.TTFT, "ttft_slo")
    tpot_ok = attainment(n.TPOT, "tpot_slo")
    requests = rate(n.REQUESTS)
    return Dashboard(
        uid="splitserve-overview",
        title="splitserve / Service overview",
        description="Latency percentiles against the SLO, throughput and goodput.",
        variables=(*VARIABLES, *SLO_VARIABLES),
        links=("splitserve-pools", "splitserve-planner"),
        rows=(
            Row(
                "Now",
                (
                    Panel(
                        "TTFT p90", (Target(quantile(n.TTFT, 0.9)),), "s", "stat", width=6, height=4
                    ),
                    Panel(
                        "TPOT p90", (Target(quantile(n.TPOT, 0.9)),), "s", "stat", width=6, height=4
                    ),
                    Panel("Requests/s", (Target(requests),), "reqps", "stat", width=6, height=4),
                    Panel(
                        "SLO attainment",
                        (Target(f"({ttft_ok}) * ({tpot_ok})"),),
                        "percentunit",
                        "stat",
                        width=6,
                        height=4,
                        min=0,
                        max=1,
                        thresholds=((0, "red"), (0.9, "orange"), (0.99, "green")),
                    ),
                ),
            ),
            Row(
                "Latency against the SLO",
                (
                    _latency_panel("Time to first token", n.TTFT, "ttft"),
                    _latency_panel("Time per output token", n.TPOT, "tpot"),
                    Panel(
                        "End-to-end latency",
                        tuple(Target(quantile(n.E2E, q), f"p{q * 100:g}") for q in QUANTILES),
                        "s",
                    ),
                    Panel(
                        "SLO attainment",
                        (
                            Target(ttft_ok, "TTFT <= $ttft_slo s"),
                            Target(tpot_ok, "TPOT <= $tpot_slo s"),
                        ),
                        "percentunit",
                        min=0,
                        max=1,
                        description="Fraction of requests within each objective (by histogram "
                        "bucket: choose the SLO among the bucket bounds above).",
                    ),
                ),
            ),
            Row(
                "Throughput and goodput",
                (
                    Panel(
                        "Requests by outcome",
                        (Target(rate(n.REQUESTS, "outcome"), "{{outcome}}"),),
                        "reqps",
                        stack=True,
                    ),
                    Panel(
                        "Goodput",
                        (
                            Target(requests, "throughput"),
                            Target(f"{requests} * ({ttft_ok}) * ({tpot_ok})", "goodput"),
                        ),
                        "reqps",
                        description="Requests/s meeting both SLOs, estimated as throughput x "
                        "TTFT attainment x TPOT attainment.",
                    ),
                    Panel(
                        "Tokens",
                        (
                            Target(rate(n.PROMPT_TOKENS), "prompt"),
                            Target(rate(n.GENERATION_TOKENS), "generated"),
                        ),
                        "short",
                        description="Tokens per second.",
                    ),
                    Panel(
                        "Disaggregation decisions",
                        (Target(rate(n.DISAGG_DECISIONS, "decision"), "{{decision}}"),),
                        "reqps",
                        stack=True,
                    ),
                ),
            ),
        ),
    )


def pools() -> Dashboard:
    kv_used = gauge(n.KV_BLOCKS_USED, BY_ROLE)
    kv_free = gauge(n.KV_BLOCKS_FREE, BY_ROLE)
    return Dashboard(
        uid="splitserve-pools",
        title="splitserve / Pools",
        description="Prefill and decode pools: replicas, queues, batches, KV cache, GPUs.",
        variables=VARIABLES,
        links=("splitserve-overview",),
        rows=(
            Row(
                "Replicas",
                (replicas_panel(width=24),),
            ),
            Row(
                "Queues and batches",
                (
                    Panel(
                        "Router queues",
                        (
                            Target(gauge(n.PREFILL_QUEUE), "prefill"),
                            Target(gauge(n.DECODE_QUEUE), "decode"),
                        ),
                        "short",
                        description="Requests waiting for a worker.",
                    ),
                    Panel(
                        "Waiting inside workers",
                        (Target(gauge(n.WAITING, BY_ROLE), "{{role}}"),),
                        "short",
                    ),
                    Panel(
                        "Running sequences",
                        (Target(gauge(n.RUNNING, BY_ROLE), "{{role}}"),),
                        "short",
                    ),
                    Panel(
                        "Worker tokens/s",
                        (
                            Target(rate(n.WORKER_PREFILL_TOKENS, BY_ROLE), "{{role}} prefill"),
                            Target(rate(n.WORKER_DECODE_TOKENS, BY_ROLE), "{{role}} decode"),
                        ),
                        "short",
                    ),
                ),
            ),
            Row(
                "KV cache",
                (
                    Panel(
                        "KV cache used",
                        (Target(f"{kv_used} / ({kv_used} + {kv_free})", "{{role}}"),),
                        "percentunit",
                        min=0,
                        max=1,
                        thresholds=((0, "green"), (0.9, "red")),
                    ),
                    Panel(
                        "Prefix cache hit rate",
                        (
                            Target(
                                f"{rate(n.PREFIX_HITS, BY_ROLE)} / "
                                f"{rate(n.PREFIX_QUERIES, BY_ROLE)}",
                                "{{role}}",
                            ),
                        ),
                        "percentunit",
                        min=0,
                        max=1,
                    ),
                ),
            ),
            Row(
                "GPUs",
                (
                    Panel(
                        "GPU utilisation",
                        (
                            Target(
                                f"{n.GPU_UTILIZATION.name}{selector(WORKERS)}",
                                "{{pod}} gpu {{gpu}}",
                            ),
                        ),
                        "percentunit",
                        min=0,
                        max=1,
                    ),
                    Panel(
                        "GPU memory used",
                        (
                            Target(
                                f"{n.GPU_MEMORY_USED.name}{selector(WORKERS)}",
                                "{{pod}} gpu {{gpu}}",
                            ),
                        ),
                        "bytes",
                    ),
                ),
            ),
            Row(
                "Router",
                (
                    Panel(
                        "Retries and migrations",
                        (Target(rate(n.ROUTER_RETRIES, "reason"), "{{reason}}"),),
                        "reqps",
                        width=24,
                    ),
                ),
            ),
        ),
    )


DASHBOARDS = {
    "overview.json": overview,
    "pools.json": pools,
    "kv-transfer.json": kv_transfer,
    "planner.json": planner,
}
"""File name in ``charts/splitserve/dashboards/`` -> builder."""
