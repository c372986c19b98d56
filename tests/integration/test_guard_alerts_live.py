"""The correctness guard end to end: real workers, routers, Prometheus with the chart's
alert rules, and the operator (kopf) against the Kubernetes API emulator.

Two services are scraped side by side. ``corrupt``: its prefill worker flips a byte of
every pushed layer (``SPLITSERVE_FAULT_KV_CORRUPT_PROB=1``) with KV checksums off, every
request disaggregated, the guard sampling one request in two. ``local``: clean workers,
every request prefilled on the decode worker. Then the guard reports a mismatch within
its sample, ``SplitserveKVMismatch`` fires for ``corrupt`` only, ``SplitserveDisaggregationOff``
for ``local`` only, and the operator sets ``KVIntegrity`` False on ``corrupt`` and True
on ``local``."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prom_fixture import PrometheusServer, prometheus_binary
from prom_stack import LiveStack, Load
from splitserve.metric_names import GUARD_CHECKS
from splitserve_operator.api.status import KV_INTEGRITY
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.k8s import INFERENCE_SERVICE
from splitserve_operator.dashboards import alerts
from splitserve_worker.kv.faults import ENV_CORRUPT, ENV_SEED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SAMPLE = 2
"""The guard re-runs one request in SAMPLE: a mismatch must show within that many."""
CORRUPT = {"namespace": "default", "inferenceservice": "corrupt"}
LOCAL = {"namespace": "default", "inferenceservice": "local"}
FAST = AutoscaleConfig(resolution_s=0.5, window_s=10, fast_window_s=5)
OFF_PARTS = (
    "sum by (inferenceservice) (increase(splitserve_requests_total[15m]))",
    'count by (inferenceservice) (splitserve_kv_blocks_free{role="prefill"})',
    'count by (inferenceservice) (splitserve_kv_blocks_free{role="decode"})',
    "sum by (inferenceservice) (increase(splitserve_kv_transfer_bytes_total[15m]))",
)
"""The off alert's terms, shown when it does not fire."""


def shipped_rules_firing_at_once() -> dict[str, Any]:
    """The chart's rules as shipped, with each ``for`` cut to nothing: the test cannot wait
    15 minutes for a condition that holds from its first evaluation."""
    spec = alerts.rules()
    for group in spec["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    return spec


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    server = PrometheusServer(
        tmp_path_factory.mktemp("prometheus"), prometheus_binary(), shipped_rules_firing_at_once()
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stacks(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory, prom: PrometheusServer
) -> Iterator[dict[str, LiveStack]]:
    corrupt = LiveStack(
        tiny_model_path,
        tmp_path_factory.mktemp("corrupt"),
        CORRUPT,
        worker_args=["--checksum-every", "0"],
        worker_env={ENV_CORRUPT: "1.0", ENV_SEED: "11"},
        router_args=[
            "--disaggregation",
            "always",
            "--set",
            f"guard.sample_share={1 / SAMPLE}",
            "--set",
            "guard.min_interval_s=3600",
        ],
    )
    local = LiveStack(
        tiny_model_path,
        tmp_path_factory.mktemp("local"),
        LOCAL,
        router_args=["--disaggregation", "never"],
    )
    live = {"corrupt": corrupt, "local": local}
    try:
        for s in live.values():
            s.start()
        prom.set_targets([t for s in live.values() for t in s.targets()])
        yield live
    finally:
        for s in live.values():
            s.stop()


def complete(base: str, i: int) -> None:
    body = {"prompt": [(i * 7919 + j * 31) % 250 + 5 for j in range(40)], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text  # wrong or not, the guard never fails a request


def mismatches_on(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.search(GUARD_CHECKS.name + r'\{outcome="mismatch"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def firing(prom: PrometheusServer, alert: str) -> set[str]:
    return {
        a["labels"].get("inferenceservice", "")
        for a in prom.alerts()
        if a["labels"]["alertname"] == alert and a["state"] == "firing"
    }


def until(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.5)
    return got


def kv_integrity(kube_client: Any, name: str) -> dict[str, Any]:
    body = kube_client.get(INFERENCE_SERVICE, "default", name) or {}
    for c in (body.get("status") or {}).get("conditions") or []:
        if c["type"] == KV_INTEGRITY:
            return dict(c)
    return {}


def test_corrupt_kv_is_caught_alerted_and_shown_on_the_inference_service(
    stacks: dict[str, LiveStack],
    prom: PrometheusServer,
    kube: Any,
    kube_client: Any,
    start_operator: Any,
    inference_service: Any,
    wait_for: Any,
) -> None:
    selector = ",".join(f'{k}="{v}"' for k, v in CORRUPT.items())
    # the guard's series are exported from the router's start: scraped at 0 before any check
    prom.wait_for(f'{GUARD_CHECKS.name}{{{selector},outcome="mismatch"}}', lambda v: v == 0.0)
    for i in range(SAMPLE):
        complete(stacks["corrupt"].base_url, i)
        complete(stacks["local"].base_url, i)
    bad = until(lambda: mismatches_on(stacks["corrupt"].base_url), 60, "the guard's verdict")
    assert bad >= 1.0  # within the configured sample
    assert mismatches_on(stacks["local"].base_url) == 0.0
    router_log = (stacks["corrupt"].workdir / "router.log").read_text()
    assert "correctness guard: request cmpl-" in router_log, router_log[-2000:]

    # the metric, and each alert for its own service only
    prom.wait_for(
        f'sum({GUARD_CHECKS.name}{{{selector},outcome="mismatch"}})', lambda v: (v or 0) >= 1
    )
    assert until(lambda: firing(prom, "SplitserveKVMismatch"), 30, "the mismatch alert") == {
        "corrupt"
    }
    # a serving service has traffic all along: the off alert reads requests over its window
    with Load(stacks["local"].base_url, 1, max_tokens=4):
        try:
            off = until(lambda: firing(prom, "SplitserveDisaggregationOff"), 60, "the off alert")
        except AssertionError as e:
            parts = {q: prom.query(q)["data"] for q in OFF_PARTS}
            raise AssertionError(f"{e}: {parts}") from None
    assert off == {"local"}  # corrupt moved KV (wrong KV, but it moved)
    assert firing(prom, "SplitserveKVMismatch") == {"corrupt"}

    # the operator reads the same increase into KVIntegrity
    start_operator(autoscale=FAST)
    for name in ("corrupt", "local"):
        kube_client.create(
            inference_service(
                name=name,
                slo={"ttft": "1s", "tpot": "50ms"},
                autoscaling={"enabled": True, "prometheusUrl": prom.url, "interval": "5s"},
            )
        )
    cond = wait_for(
        lambda: (
            kv_integrity(kube_client, "corrupt").get("status") == "False"
            and kv_integrity(kube_client, "corrupt")
        ),
        timeout=60,
        message="KVIntegrity=False on corrupt",
    )
    assert cond["reason"] == "GuardMismatch" and "correctness guard" in cond["message"]
    clean = wait_for(
        lambda: (
            kv_integrity(kube_client, "local").get("status") == "True"
            and kv_integrity(kube_client, "local")
        ),
        timeout=60,
        message="KVIntegrity=True on local",
    )
    assert clean["reason"] == "NoMismatch"
