"""PromQL for the dashboards: the selectors of one InferenceService's series, the query
builders every panel uses, and the dashboards' variables."""

from __future__ import annotations

import splitserve.metric_names as n
from prometheus_client.utils import floatToGoString

from splitserve_operator.api.series import DEFAULT_SELECTOR
from splitserve_operator.dashboards.grafana import Target, Variable

RATE = "$__rate_interval"
WORKERS = DEFAULT_SELECTOR.format(namespace="$namespace", name="$service")
"""Worker and router series of the chosen InferenceService."""
OPERATOR = 'namespace="$namespace",service="$service"'
"""The operator's series about the chosen InferenceService (its own labels)."""
BY_ROLE = "role"
QUANTILES = (0.5, 0.9, 0.99)


def le_values(spec: n.MetricSpec) -> tuple[str, ...]:
    """A histogram's ``le`` values as prometheus_client writes them ("1.0", "0.05")."""
    return tuple(floatToGoString(b) for b in spec.buckets)


def match(label: str, value: str, op: str = "=") -> str:
    """One PromQL label matcher, ``label="value"``."""
    return label + op + '"' + value + '"'


def selector(base: str, extra: str = "") -> str:
    """A PromQL series selector from matcher lists, ``{a="1",b="2"}``."""
    return "{" + ",".join(p for p in (base, extra) if p) + "}"


def quantile(spec: n.MetricSpec, q: float, by: str = "", extra: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return (
        f"histogram_quantile({q:g}, sum by ({group}) "
        f"(rate({spec.name}_bucket{selector(WORKERS, extra)}[{RATE}])))"
    )


def rate(spec: n.MetricSpec, by: str = "", extra: str = "", base: str = WORKERS) -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({spec.name}{selector(base, extra)}[{RATE}]))"


def gauge(spec: n.MetricSpec, by: str = "", extra: str = "", base: str = WORKERS) -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} ({spec.name}{selector(base, extra)})"


def attainment(spec: n.MetricSpec, slo_var: str) -> str:
    """Fraction of requests at or under the SLO bucket chosen in ``slo_var``."""
    return (
        f"sum(rate({spec.name}_bucket{selector(WORKERS, match('le', '$' + slo_var))}[{RATE}])) / "
        f"sum(rate({spec.name}_count{selector(WORKERS)}[{RATE}]))"
    )


def slo_line(objective: str) -> Target:
    return Target(
        f"max({n.SLO_TARGET.name}{selector(OPERATOR, match('objective', objective))})", "SLO"
    )


VARIABLES = (
    Variable("datasource", "Prometheus", kind="datasource"),
    Variable(
        "namespace",
        "Namespace",
        f"label_values({n.REPLICAS_DESIRED.name}, namespace)",
        description="Namespace of the InferenceService",
    ),
    Variable(
        "service",
        "InferenceService",
        f'label_values({n.REPLICAS_DESIRED.name}{{namespace="$namespace"}}, service)',
    ),
)


def _slo_variable(name: str, label: str, spec: n.MetricSpec, default: str) -> Variable:
    """A choice of ``spec``'s bucket bounds, ``default`` first."""
    bounds = le_values(spec)
    assert default in bounds, (spec.name, default)
    return Variable(
        name,
        label,
        kind="custom",
        options=(default, *(b for b in bounds if b != default)),
        description="A histogram bucket bound: attainment counts requests at or under it",
    )


SLO_VARIABLES = (
    _slo_variable("ttft_slo", "TTFT SLO (s)", n.TTFT, "1.0"),
    _slo_variable("tpot_slo", "TPOT SLO (s)", n.TPOT, "0.05"),
)
