"""The KV transfer and planner dashboards: the handoff between pools and the scaling loop.

Queries come from the same builders as the serving dashboards (:mod:`.queries`).
"""

from __future__ import annotations

import splitserve.metric_names as n

from splitserve_operator.dashboards.grafana import Dashboard, Panel, Row, Target
from splitserve_operator.dashboards.queries import (
    OPERATOR,
    QUANTILES,
    RATE,
    VARIABLES,
    WORKERS,
    gauge,
    match,
    quantile,
    rate,
    selector,
)


def replicas_panel(width: int = 12) -> Panel:
    """Desired and ready replicas per pool, as the operator reports them."""
    return Panel(
        "Replicas desired and ready",
        (
            Target(gauge(n.REPLICAS_DESIRED, "pool", base=OPERATOR), "{{pool}} desired"),
            Target(gauge(n.REPLICAS_READY, "pool", base=OPERATOR), "{{pool}} ready"),
        ),
        "short",
        width=width,
    )


def kv_transfer() -> Dashboard:
    by = "backend"
    return Dashboard(
        uid="splitserve-kv-transfer",
        title="splitserve / KV transfer",
        description="KV cache moved from prefill to decode workers, per backend.",
        variables=VARIABLES,
        links=("splitserve-overview",),
        rows=(
            Row(
                "Transfers",
                (
                    Panel(
                        "Bytes/s",
                        (
                            Target(
                                rate(n.KV_TRANSFER_BYTES, "backend, direction"),
                                "{{backend}} {{direction}}",
                            ),
                        ),
                        "Bps",
                    ),
                    Panel(
                        "Transfer duration",
                        tuple(
                            Target(
                                quantile(n.KV_TRANSFER_DURATION, q, by),
                                f"{{{{backend}}}} p{q * 100:g}",
                            )
                            for q in QUANTILES
                        ),
                        "s",
                    ),
                    Panel(
                        "Transfers/s",
                        (
                            Target(
                                f"sum by (backend) (rate({n.KV_TRANSFER_DURATION.name}_count"
                                f"{selector(WORKERS)}[{RATE}]))",
                                "{{backend}}",
                            ),
                        ),
                        "ops",
                    ),
                    Panel(
                        "Failures",
                        (
                            Target(
                                rate(n.KV_TRANSFER_FAILURES, "backend, reason"),
                                "{{backend}} {{reason}}",
                            ),
                        ),
                        "ops",
                        thresholds=((0, "green"), (0.001, "red")),
                    ),
                    Panel(
                        "Mean bytes per transfer",
                        (
                            Target(
                                f"{rate(n.KV_TRANSFER_BYTES, by, match('direction', 'sent'))} / "
                                f"sum by (backend) (rate({n.KV_TRANSFER_DURATION.name}_count"
                                f"{selector(WORKERS)}[{RATE}]))",
                                "{{backend}}",
                            ),
                        ),
                        "bytes",
                        width=24,
                    ),
                ),
            ),
        ),
    )


def planner() -> Dashboard:
    return Dashboard(
        uid="splitserve-planner",
        title="splitserve / Planner",
        description="What the SLO-driven planner saw and decided, per pool.",
        variables=VARIABLES,
        links=("splitserve-overview", "splitserve-pools"),
        rows=(
            Row(
                "Decisions",
                (
                    replicas_panel(),
                    Panel(
                        "Scaling decisions",
                        (
                            Target(
                                f"sum by (pool, direction) (increase("
                                f"{n.PLANNER_DECISIONS.name}"
                                f"{selector(OPERATOR, match('direction', 'hold', '!='))}[{RATE}]))",
                                "{{pool}} {{direction}}",
                            ),
                        ),
                        "short",
                        description="Scale-ups and scale-downs per pool.",
                    ),
                    Panel(
                        "Latency over SLO, as the planner saw it",
                        (Target(gauge(n.PLANNER_SLO_RATIO, "pool", base=OPERATOR), "{{pool}}"),),
                        "short",
                        thresholds=((0, "green"), (1.0, "red")),
                        description="prefill: TTFT / SLO; decode: TPOT / SLO. Above 1 breaks "
                        "the SLO; below 0.7 a pool may shrink.",
                    ),
                    Panel(
                        "Learned capacity per replica",
                        (Target(gauge(n.PLANNER_CAPACITY, "pool", base=OPERATOR), "{{pool}}"),),
                        "short",
                        description="prefill: prompt tokens/s; decode: generated "
                        "tokens/s per replica.",
                    ),
                    Panel(
                        "Metrics available",
                        (Target(gauge(n.PLANNER_METRICS_AVAILABLE, base=OPERATOR), "available"),),
                        "short",
                        min=0,
                        max=1,
                        width=24,
                        thresholds=((0, "red"), (1, "green")),
                        description="0: the planner holds replicas for lack of metrics.",
                    ),
                ),
            ),
        ),
    )
