"""The chart's alert rules: generated from the contract's metric names (the committed
file must be fresh), every expression names only series the code exports, promtool
accepts them, and the chart wraps them in a PrometheusRule when
``prometheusRule.enabled``. That they fire on the right series against a live Prometheus:
tests/integration/test_alerts_live.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import helm_chart as chart
import pytest
from splitserve.metric_names import GUARD_CHECKS, KV_TRANSFER_BYTES, exported_series_names
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.dashboards import alerts
from splitserve_operator.dashboards.__main__ import ALERTS_OUT, RULES_FILE

pytestmark = pytest.mark.unit

RULES = chart.CHART / "alerts" / RULES_FILE
METRIC = re.compile(r"\b(splitserve_[a-z0-9_]+)\b")


@pytest.fixture
def helm() -> None:
    """The tests that render the chart need helm: skipped where it is absent, failed in CI."""
    if chart.find_helm() is None:
        if os.environ.get("CI"):
            pytest.fail("helm is missing in CI: .ci/install-tools.sh should have installed it")
        pytest.skip("helm not installed (.ci/install-tools.sh)")


def _rules() -> list[dict[str, object]]:
    return [r for g in alerts.rules()["groups"] for r in g["rules"]]


def test_committed_rules_equal_the_builders_output() -> None:
    assert RULES.parent == chart.ROOT / ALERTS_OUT
    assert RULES.read_text() == alerts.dump(alerts.rules()), (
        "stale: run python -m splitserve_operator.dashboards"
    )


def test_every_alert_names_only_exported_series() -> None:
    exported = exported_series_names()
    names = {str(r["alert"]) for r in _rules()}
    assert names == {"SplitserveKVMismatch", "SplitserveDisaggregationOff"}
    for rule in _rules():
        named = set(METRIC.findall(str(rule["expr"])))
        assert named, rule
        assert named <= exported, (rule["alert"], sorted(named - exported))
    assert GUARD_CHECKS.name in str(_rules()[0]["expr"])
    assert KV_TRANSFER_BYTES.name in str(_rules()[1]["expr"])


def test_the_mismatch_alert_looks_back_as_far_as_the_kv_integrity_condition() -> None:
    assert alerts.MISMATCH_WINDOW == "10m"
    assert AutoscaleConfig().integrity_window_s == 600.0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 2 rules found" in done.stdout


@pytest.mark.usefixtures("helm")
def test_the_chart_ships_the_rules_in_a_prometheus_rule_when_asked() -> None:
    assert not [d for d in chart.template() if d["kind"] == "PrometheusRule"]
    (rule,) = [
        d
        for d in chart.template(
            sets=[
                "prometheusRule.enabled=true",
                "prometheusRule.labels.release=kube-prometheus-stack",
                "prometheusRule.additionalLabels.team=ml",
                "prometheusRule.namespace=monitoring",
            ]
        )
        if d["kind"] == "PrometheusRule"
    ]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    shipped = json.loads(RULES.read_text())
    for group in shipped["groups"]:
        for r in group["rules"]:
            r["labels"]["team"] = "ml"  # added to every alert, its severity kept
    assert rule["spec"] == shipped


@pytest.mark.usefixtures("helm")
def test_the_chart_lints_strictly_with_the_rule_on() -> None:
    done = chart.helm("lint", "--strict", str(chart.CHART), "--set", "prometheusRule.enabled=true")
    assert done.returncode == 0, done.stdout + done.stderr
