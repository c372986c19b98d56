"""The Helm chart with the real helm binary: lint, template, values schema, and the
rendered manifests valid for Kubernetes and within the "restricted" profile."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import helm_chart as chart
import kubernetes_validate
import pytest
from splitserve_operator.render.security import restricted_violations

pytestmark = pytest.mark.unit

K8S_VERSION = "1.32"


@pytest.fixture(scope="module", autouse=True)
def _helm() -> None:
    if chart.find_helm() is None:
        if os.environ.get("CI"):
            pytest.fail("helm is missing in CI: .ci/install-tools.sh should have installed it")
        pytest.skip("helm is not installed: run bash .ci/install-tools.sh .venv")


def test_lint_strict() -> None:
    result = chart.helm("lint", "--strict", str(chart.CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    result = chart.helm(
        "lint",
        "--strict",
        str(chart.CHART),
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "operator.watchNamespaces={a,b}",
        "--set",
        "certManager.enabled=true",
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("serviceMonitor.enabled=true",),
        ("operator.watchNamespaces={team-a,team-b}",),
        ("serviceAccount.create=false", "serviceAccount.name=existing", "rbac.create=false"),
        (
            "tests.inferenceService.name=smollm2",
            "tests.inferenceService.namespace=team-a",
            "tests.apiKeySecret.name=smollm2-api-key",
        ),
        (
            "prometheus.url=https://thanos-querier.monitoring.svc:9091",
            "prometheus.bearerTokenSecret.name=prometheus-reader",
            "prometheus.caConfigMap.name=service-ca",
        ),
        ("certManager.enabled=true", "certManager.namespace=team-a"),
    ],
    ids=[
        "defaults",
        "servicemonitor",
        "namespaced",
        "bring-your-own-account",
        "helm-test",
        "prometheus-auth",
        "cert-manager",
    ],
)
def test_rendered_manifests_are_valid(sets: tuple[str, ...]) -> None:
    documents = chart.template(sets=sets, include_crds=True)
    kinds = [d["kind"] for d in documents]
    assert "Deployment" in kinds and "CustomResourceDefinition" in kinds
    for doc in documents:
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
            continue  # not a built-in kind: no schema ships with kubernetes-validate
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_operator_pod_is_restricted_and_runs_the_operator() -> None:
    (deployment,) = [d for d in chart.template() if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    # no fixed IDs unless configured: the platform (OpenShift's restricted-v2) assigns them
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (fixed,) = [
        d
        for d in chart.template(
            sets=["podSecurityContext.runAsUser=2000", "podSecurityContext.fsGroup=2000"]
        )
        if d["kind"] == "Deployment"
    ]
    assert fixed["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 2000
    (container,) = pod["containers"]
    assert container["image"] == "splitserve/operator:0.1.0"
    assert "--router-cluster-role=splitserve-router" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_two_replicas_elect_one_leader_and_spread_out() -> None:
    documents = chart.template()
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate",
                                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}  # fmt: skip
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert "--leader-election" in container["args"]
    assert "--lease-name=splitserve" in container["args"]
    env = {
        e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        for e in container["env"]
    }
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    (budget,) = [d for d in documents if d["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["maxUnavailable"] == 1


def test_one_replica_without_leader_election_recreates() -> None:
    documents = chart.template(sets=["operator.replicas=1", "operator.leaderElection=false"])
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not [d for d in documents if d["kind"] in ("Role", "PodDisruptionBudget")]
    failed = chart.helm("template", "x", str(chart.CHART), "--set", "operator.replicas=2",
                        "--set", "operator.leaderElection=false", check=False)  # fmt: skip
    assert failed.returncode != 0 and "needs operator.leaderElection" in failed.stderr


def test_watch_namespaces_bind_per_namespace() -> None:
    documents = chart.template(sets=["operator.watchNamespaces={team-a,team-b}"])
    kinds = [(d["kind"], d["metadata"].get("namespace")) for d in documents]
    assert ("ClusterRoleBinding", None) not in kinds
    assert ("RoleBinding", "team-a") in kinds and ("RoleBinding", "team-b") in kinds
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_service_monitor_scrapes_the_workload_metrics_ports() -> None:
    (monitor,) = [
        d
        for d in chart.template(sets=["serviceMonitor.enabled=true"])
        if d["kind"] == "ServiceMonitor"
    ]
    assert (
        monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/managed-by"]
        == "splitserve-operator"
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    labels = {r["targetLabel"] for r in monitor["spec"]["endpoints"][0]["relabelings"]}
    assert labels == {"inferenceservice", "pool"}
    assert not [d for d in chart.template() if d["kind"] == "ServiceMonitor"]


def test_operator_metrics_are_served_and_scraped_with_their_own_labels() -> None:
    documents = chart.template(sets=["serviceMonitor.enabled=true", "operator.metricsPort=9300"])
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=9300" in container["args"]
    assert {"name": "metrics", "containerPort": 9300, "protocol": "TCP"} in container["ports"]
    (monitor,) = [d for d in documents if d["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    off = chart.template(sets=["serviceMonitor.enabled=true", "serviceMonitor.operator=false"])
    assert not [d for d in off if d["kind"] == "PodMonitor"]


@pytest.mark.parametrize(
    "bad",
    [
        "operator.workers=0",
        "image.pullPolicy=Sometimes",
        "unknownKey=1",
        "operator.watchNamespaces={Bad_NS}",
        "serviceMonitor.interval=soon",
        "prometheus.bearerTokenFile=/var/run/secrets/token",  # for which Prometheus?
        "prometheus.url=prometheus:9090",
        "podSecurityContext.runAsNonRoot=false",
        "tests.inferenceService.name=Bad_Name",
    ],
)
def test_values_schema_rejects_bad_values(bad: str) -> None:
    with pytest.raises(subprocess.CalledProcessError) as exc:
        chart.template(sets=[bad])
    assert (
        "values don't meet the specifications" in exc.value.stderr
        or "schema" in exc.value.stderr.lower()
    )


def test_notes_render() -> None:
    out = chart.helm(
        "install", "splitserve", str(chart.CHART), "--dry-run=client", "--namespace", "x"
    )
    notes = out.stdout.split("NOTES:", 1)[1]
    assert (
        "kubectl get sisvc" in notes and "It serves InferenceServices in every namespace" in notes
    )


def _operator_container(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_prometheus_credentials_reach_the_operator_for_their_url_only() -> None:
    assert not [a for a in _operator_container(chart.template())["args"] if "prometheus" in a]
    documents = chart.template(
        sets=[
            "prometheus.url=https://thanos-querier.monitoring.svc:9091",
            "prometheus.bearerTokenSecret.name=prometheus-reader",
            "prometheus.caConfigMap.name=service-ca",
            "prometheus.caConfigMap.key=service-ca.crt",
        ]
    )
    container = _operator_container(documents)
    assert "--prometheus-auth-url=https://thanos-querier.monitoring.svc:9091" in container["args"]
    assert (
        "--prometheus-bearer-token-file=/var/run/secrets/prometheus/token/token"
        in container["args"]
    )
    assert "--prometheus-ca-file=/var/run/secrets/prometheus/ca/service-ca.crt" in container["args"]
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["prometheus-token"]["secret"]["secretName"] == "prometheus-reader"
    assert volumes["prometheus-ca"]["configMap"]["name"] == "service-ca"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/run/secrets/prometheus/token", "/var/run/secrets/prometheus/ca"} <= mounts
    # the operator's own token, as a file already in the pod
    own = _operator_container(
        chart.template(
            sets=[
                "prometheus.url=https://p:9091",
                "prometheus.bearerTokenFile=/var/run/secrets/kubernetes.io/serviceaccount/token",
            ]
        )
    )
    assert (
        "--prometheus-bearer-token-file=/var/run/secrets/kubernetes.io/serviceaccount/token"
        in own["args"]
    )
    # every flag the chart writes is one the operator's own CLI takes
    import argparse

    from splitserve_operator.commands.operator import add_arguments, prometheus_auth

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    auth = prometheus_auth(parser.parse_args(own["args"]))
    assert auth is not None and auth.url == "https://p:9091"


def test_helm_test_asks_the_router_for_its_models() -> None:
    assert not [d for d in chart.template() if d["kind"] == "Pod"]  # nothing to ask
    documents = chart.template(
        sets=[
            "tests.inferenceService.name=smollm2",
            "tests.inferenceService.namespace=team-a",
            "tests.apiKeySecret.name=smollm2-api-key",
        ]
    )
    (test,) = [d for d in documents if d["kind"] == "Pod"]
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test["metadata"]["namespace"] == "team-a"
    spec = test["spec"]
    assert spec["restartPolicy"] == "Never" and restricted_violations(spec) == []
    (container,) = spec["containers"]
    assert container["image"] == "splitserve/operator:0.1.0"  # Python, already pulled
    env = {e["name"]: e for e in container["env"]}
    assert env["ROUTER_URL"]["value"] == "http://smollm2-router.team-a.svc:8000"
    assert env["API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "smollm2-api-key", "key": "key"}
    assert "/v1/models" in container["args"][0]


def test_cert_manager_makes_the_secret_an_inference_service_names() -> None:
    """Off by default; on, a CA and one certificate for the name the operator has every
    caller check, good for both ends of mutual TLS, in the Secret form workers mount."""
    from splitserve_operator.api.models import DEFAULT_TLS_SERVER_NAME
    from splitserve_operator.render.commands import TLS_KEYS

    assert not [d for d in chart.template() if d["apiVersion"].startswith("cert-manager.io/")]
    docs = [d for d in chart.template(sets=("certManager.enabled=true",))
            if d["apiVersion"].startswith("cert-manager.io/")]  # fmt: skip
    by_kind_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert sorted(by_kind_name) == [
        ("Certificate", "splitserve-ca"), ("Certificate", "splitserve-tls"),
        ("Issuer", "splitserve-ca"), ("Issuer", "splitserve-selfsigned"),
    ]  # fmt: skip
    ca, leaf = (
        by_kind_name[("Certificate", "splitserve-ca")],
        by_kind_name[("Certificate", "splitserve-tls")],
    )
    assert ca["spec"]["isCA"] and ca["spec"]["issuerRef"]["name"] == "splitserve-selfsigned"
    assert (
        by_kind_name[("Issuer", "splitserve-ca")]["spec"]["ca"]["secretName"]
        == ca["spec"]["secretName"]
    )
    assert leaf["spec"]["issuerRef"]["name"] == "splitserve-ca"
    assert leaf["spec"]["secretName"] == "splitserve-tls"
    assert leaf["spec"]["dnsNames"] == [DEFAULT_TLS_SERVER_NAME]
    assert {"server auth", "client auth"} <= set(leaf["spec"]["usages"])
    assert TLS_KEYS == ("tls.crt", "tls.key", "ca.crt")  # what a CA Issuer's Secret holds
