"""On a real cluster (runs only when KUBECONFIG is set; skipped otherwise): the chart
installed (tests/e2e/conftest.py), the CPU example applied in a namespace that enforces
the "restricted" Pod Security Standard, the Deployments waited for, drift repaired,
deleted. ``SPLITSERVE_E2E_READY=1`` also waits for the model to be Ready (pulls weights:
slow)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from cluster_kit import get as _get
from cluster_kit import kubectl, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "charts" / "splitserve" / "examples" / "inferenceservice-cpu.yaml"

if not os.environ.get("KUBECONFIG"):
    pytest.skip(
        "e2e tests need a real cluster: set KUBECONFIG to run them", allow_module_level=True
    )


def test_crd_is_installed(installed: dict[str, str]) -> None:
    crd = json.loads(kubectl("get", "crd", "inferenceservices.splitserve.io", "-o", "json").stdout)
    assert crd["spec"]["names"]["shortNames"] == ["sisvc"]


def test_the_api_server_enforces_the_schema(installed: dict[str, str]) -> None:
    bad = yaml.safe_load(EXAMPLE.read_text())
    bad["metadata"]["name"] = "invalid"
    bad["spec"]["decode"]["replicas"] = -1
    out = kubectl(
        "apply", "-n", installed["app"], "-f", "-", check=False, input_=yaml.safe_dump(bad)
    )
    assert out.returncode != 0 and "replicas" in out.stderr


def test_example_comes_up_under_the_restricted_profile_and_goes_away(
    installed: dict[str, str],
) -> None:
    ns = installed["app"]
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["image"] = os.environ.get("SPLITSERVE_WORKER_IMAGE", doc["spec"]["image"])
    name = doc["metadata"]["name"]
    kubectl("apply", "-n", ns, "-f", "-", input_=yaml.safe_dump(doc))
    for pool in ("prefill", "decode", "router"):
        deployment = f"{name}-{pool}"

        def exists(d: str = deployment) -> dict[str, object] | None:
            return _get("deployment", d, ns)

        wait_until(f"Deployment {deployment}", 120, exists)
    status = wait_until(
        "observedGeneration",
        120,
        lambda: (
            (_get("inferenceservice", name, ns) or {}).get("status", {}).get("observedGeneration")
        ),
    )
    assert status == 1

    # The restricted profile admitted the pods: no ReplicaSet reports FailedCreate.
    def pods_admitted() -> bool:
        sets = json.loads(kubectl("get", "replicasets", "-n", ns, "-o", "json").stdout)["items"]
        failed = [
            c
            for rs in sets
            for c in rs.get("status", {}).get("conditions", [])
            if c.get("reason") == "FailedCreate"
        ]
        assert not failed, failed
        pods = json.loads(kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
        return len(pods) >= 3

    wait_until("pods created", 180, pods_admitted)
    if os.environ.get("SPLITSERVE_E2E_READY") == "1":
        wait_until(
            "Ready",
            1800,
            lambda: any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (_get("inferenceservice", name, ns) or {})
                .get("status", {})
                .get("conditions", [])
            ),
        )
    # Drift repair on a real API server.
    kubectl("scale", "deployment", f"{name}-decode", "-n", ns, "--replicas=3")
    wait_until(
        "replicas restored",
        120,
        lambda: (_get("deployment", f"{name}-decode", ns) or {})["spec"]["replicas"] == 1,
    )
    kubectl("delete", "inferenceservice", name, "-n", ns, "--wait=true")
    wait_until(
        "garbage collection",
        180,
        lambda: all(
            _get("deployment", f"{name}-{pool}", ns) is None
            for pool in ("prefill", "decode", "router")
        ),
    )
