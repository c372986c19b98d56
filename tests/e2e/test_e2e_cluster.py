"""On a real cluster (runs only when KUBECONFIG is set; skipped otherwise):
helm install the chart, apply the CPU example in a namespace that enforces the
"restricted" Pod Security Standard, wait for the Deployments, delete, uninstall.

Images: ``SPLITSERVE_OPERATOR_IMAGE`` and ``SPLITSERVE_WORKER_IMAGE`` (repository:tag,
default ``splitserve/operator:0.1.0`` and ``splitserve/worker:0.1.0``) must be pullable
by the cluster (``kind load docker-image ...`` for kind). ``SPLITSERVE_E2E_READY=1`` also
waits for the model to be Ready (pulls weights: slow).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_chart as chart
import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "charts" / "splitserve" / "examples" / "inferenceservice-cpu.yaml"

if not os.environ.get("KUBECONFIG"):
    pytest.skip(
        "e2e tests need a real cluster: set KUBECONFIG to run them", allow_module_level=True
    )


def _kubectl_binary() -> str:
    local = ROOT / ".venv" / "bin" / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl is not installed (bash .ci/install-tools.sh .venv)")
    return found


def kubectl(
    *args: str, check: bool = True, input_: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_kubectl_binary(), *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=300,
        input=input_,
    )


def wait_until(what: str, timeout: float, fn: Any) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(2)


def _split(image: str) -> tuple[str, str]:
    repo, _, tag = image.rpartition(":")
    return (repo, tag) if repo and "/" not in tag else (image, "latest")


@pytest.fixture(scope="module")
def installed() -> Iterator[dict[str, str]]:
    if chart.find_helm() is None:
        pytest.fail("helm is not installed (bash .ci/install-tools.sh .venv)")
    suffix = uuid.uuid4().hex[:6]
    release, system_ns, app_ns = f"sse2e-{suffix}", f"splitserve-e2e-{suffix}", f"e2e-{suffix}"
    repo, tag = _split(os.environ.get("SPLITSERVE_OPERATOR_IMAGE", "splitserve/operator:0.1.0"))
    chart.helm(
        "install",
        release,
        str(chart.CHART),
        "--namespace",
        system_ns,
        "--create-namespace",
        "--set",
        f"image.repository={repo}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "operator.resyncSeconds=30",
        "--wait",
        "--timeout",
        "5m",
    )
    kubectl("create", "namespace", app_ns)
    kubectl(
        "label",
        "namespace",
        app_ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )
    try:
        yield {"release": release, "system": system_ns, "app": app_ns}
    finally:
        kubectl("delete", "namespace", app_ns, "--wait=false", check=False)
        chart.helm("uninstall", release, "--namespace", system_ns, check=False)
        kubectl("delete", "namespace", system_ns, "--wait=false", check=False)


def _get(kind: str, name: str, ns: str) -> dict[str, Any] | None:
    out = kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


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
        wait_until(
            f"Deployment {name}-{pool}",
            120,
            lambda pool=pool: _get("deployment", f"{name}-{pool}", ns),
        )
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
