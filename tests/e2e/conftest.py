"""The e2e suite's cluster: the chart installed once per module in a fresh release and
namespaces, an application namespace under the "restricted" Pod Security Standard, all
removed afterwards. Runs only when ``KUBECONFIG`` is set (see README.md here).

Images: ``SPLITSERVE_OPERATOR_IMAGE`` and ``SPLITSERVE_WORKER_IMAGE`` (repository:tag,
default ``splitserve/operator:0.1.0`` and ``splitserve/worker:0.1.0``) must be pullable by
the cluster (``kind load docker-image ...`` for kind).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import helm_chart as chart
import pytest
from cluster_kit import kubectl, split_image


@pytest.fixture(scope="module")
def installed() -> Iterator[dict[str, str]]:
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("e2e tests need a real cluster: set KUBECONFIG to run them")
    if chart.find_helm() is None:
        pytest.fail("helm is not installed (bash .ci/install-tools.sh .venv)")
    suffix = uuid.uuid4().hex[:6]
    release, system_ns, app_ns = f"sse2e-{suffix}", f"splitserve-e2e-{suffix}", f"e2e-{suffix}"
    repo, tag = split_image(
        os.environ.get("SPLITSERVE_OPERATOR_IMAGE", "splitserve/operator:0.1.0")
    )
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
