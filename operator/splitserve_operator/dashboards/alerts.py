"""The chart's Prometheus alert rules, as code from the contract's metric names: what the
chart's PrometheusRule (``templates/prometheusrule.yaml``) carries, written to
``charts/splitserve/alerts/splitserve.rules.json`` by ``python -m
splitserve_operator.dashboards``.

- ``SplitserveKVMismatch``: the router's correctness guard re-ran a disaggregated request
  with local prefill and got other tokens (``splitserve_guard_checks_total`` with
  ``outcome="mismatch"`` rose within :data:`MISMATCH_WINDOW`). The operator's
  ``KVIntegrity`` condition reads the same increase over the same window.
- ``SplitserveDisaggregationOff``: a service with both a prefill and a decode pool
  serving requests moved no KV bytes at all over :data:`OFF_WINDOW`: disaggregation is
  silently off (every request planned local, or every handoff falling back to it).

Series are grouped by ``namespace`` and ``inferenceservice``, the labels the chart's
ServiceMonitor puts on every worker and router series (:mod:`splitserve_operator.api.series`).
"""

from __future__ import annotations

import json
from typing import Any

import splitserve.metric_names as n

MISMATCH_WINDOW = "10m"
"""How long one mismatch keeps the alert (and ``KVIntegrity=False``) on; the operator's
``AutoscaleConfig.integrity_window_s`` is the same 600 s."""
OFF_WINDOW = "15m"
"""How long a serving service may move no KV before it is said to be disaggregating no
more: longer than any quiet spell of a service that has traffic."""
OFF_FOR = "15m"
"""The disaggregation-off condition must hold this long before it fires."""
BY = "namespace, inferenceservice"
ON = f"on ({BY})"


def mismatch_expr(window: str = MISMATCH_WINDOW) -> str:
    return f'sum by ({BY}) (increase({n.GUARD_CHECKS.name}{{outcome="mismatch"}}[{window}])) > 0'


def disaggregation_off_expr(window: str = OFF_WINDOW) -> str:
    """Requests served, a prefill and a decode worker up, and no KV bytes moved (the
    ``unless`` also fires where the byte counter was never created: nothing ever moved)."""

    def pool(role: str) -> str:
        return f'(count by ({BY}) ({n.KV_BLOCKS_FREE.name}{{role="{role}"}}) > 0)'

    return (
        f"(sum by ({BY}) (increase({n.REQUESTS.name}[{window}])) > 0)"
        f" and {ON} {pool('prefill')}"
        f" and {ON} {pool('decode')}"
        f" unless {ON} (sum by ({BY}) (increase({n.KV_TRANSFER_BYTES.name}[{window}])) > 0)"
    )


def rules() -> dict[str, Any]:
    """The PrometheusRule's ``spec``: one group of alerts."""
    where = "{{ $labels.namespace }}/{{ $labels.inferenceservice }}"
    return {
        "groups": [
            {
                "name": "splitserve.disaggregation",
                "rules": [
                    {
                        "alert": "SplitserveKVMismatch",
                        "expr": mismatch_expr(),
                        "for": "0m",
                        "labels": {"severity": "critical"},
                        "annotations": {
                            "summary": f"Disaggregated requests of {where} decode wrong tokens",
                            "description": (
                                "The router's correctness guard re-ran {{ $value }} "
                                "disaggregated request(s) in the last "
                                f"{MISMATCH_WINDOW} with local prefill and got other "
                                "tokens: the KV that moved from the prefill pool is not the "
                                "KV the decode worker computes. The router logs each "
                                "('correctness guard: request ...'); the InferenceService's "
                                "KVIntegrity condition is False. Turn on "
                                "kvTransfer.checksums to catch corrupt transfers, or set "
                                "router.settings.disaggregation to never until it is fixed."
                            ),
                        },
                    },
                    {
                        "alert": "SplitserveDisaggregationOff",
                        "expr": disaggregation_off_expr(),
                        "for": OFF_FOR,
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": f"{where} serves with both pools but moves no KV",
                            "description": (
                                "Requests were served and prefill and decode workers are "
                                f"up, yet no KV bytes moved in {OFF_WINDOW}: every request "
                                "is prefilled on its decode worker, and the prefill pool "
                                "idles. See splitserve_disaggregation_decisions_total and "
                                "splitserve_planned_remote_ran_local_total, the router's "
                                "disaggregation setting and the prefill workers' health."
                            ),
                        },
                    },
                ],
            }
        ]
    }


def dump(spec: dict[str, Any]) -> str:
    """The exact text committed for the rules (stable key order, trailing newline)."""
    return json.dumps(spec, indent=2, sort_keys=True) + "\n"
