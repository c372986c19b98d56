"""The operator, kopf and the official client against the API emulator over HTTP: an
InferenceService with a pool of switchable workers gets its Deployment, and the
operator keeps it as the spec says."""

from __future__ import annotations

import pytest
from operator_helpers import converged, deployment, replicas
from splitserve_operator.control.k8s import INFERENCE_SERVICE

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_flex_pool_becomes_a_deployment_of_switchable_workers(
    kube, kube_client, start_operator, inference_service, wait_for
) -> None:
    start_operator()
    kube_client.create(inference_service(flex={"replicas": 2, "gpus": 0}))
    wait_for(lambda: deployment(kube_client, "demo-flex") is not None, message="demo-flex")
    wait_for(lambda: converged(kube_client), message="converged")
    budgets = {
        b["metadata"]["name"] for b in kube.objects("policy/v1/poddisruptionbudgets", "default")
    }
    assert "demo-flex" in budgets
    made = deployment(kube_client, "demo-flex")
    assert made is not None and made["spec"]["replicas"] == 2
    template = made["spec"]["template"]
    assert template["metadata"]["labels"]["splitserve.io/role"] == "both"
    assert "--switchable" in template["spec"]["containers"][0]["args"]
    # the spec's size reaches it; the fixed pools keep theirs
    kube_client.patch(INFERENCE_SERVICE, "default", "demo", {"spec": {"flex": {"replicas": 4}}})
    wait_for(lambda: replicas(kube_client, "demo-flex") == 4, message="flex at 4")
    assert replicas(kube_client, "demo-decode") == 1
