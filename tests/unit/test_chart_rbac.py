"""Least privilege: the verbs the chart grants, listed, and no wildcard anywhere."""

from __future__ import annotations

import os

import helm_chart as chart
import pytest

pytestmark = pytest.mark.unit

# Every permission the operator holds, and why (templates/rbac.yaml says the same).
EXPECTED = {
    ("splitserve.io", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("splitserve.io", "inferenceservices/status"): {"get", "patch"},
    ("splitserve.io", "inferenceservices/finalizers"): {"update"},
    ("splitserve.io", "workerpools"): {"get", "list", "watch", "create", "patch"},
    ("splitserve.io", "workerpools/status"): {"patch"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch"},
    ("", "services"): {"get", "create", "patch"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "serviceaccounts"): {"get", "create", "patch"},
    ("", "secrets"): {"create"},
    ("", "events"): {"create"},
    ("", "pods"): {"list", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch"},
    ("gateway.networking.k8s.io", "httproutes"): {"get", "create", "patch"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "create", "patch"},
    ("rbac.authorization.k8s.io", "clusterroles"): {"bind"},
}
ROUTER = {
    ("", "pods"): {"get", "list", "watch"},
    ("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},
}


@pytest.fixture(scope="module")
def documents() -> list[dict]:
    if chart.find_helm() is None:
        if os.environ.get("CI"):
            pytest.fail("helm is missing in CI")
        pytest.skip("helm is not installed: run bash .ci/install-tools.sh .venv")
    return chart.template()


def verbs(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_no_wildcards(documents: list[dict]) -> None:
    for doc in documents:
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        for rule in doc["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), (doc["metadata"]["name"], rule)
            assert not any("*" in r for r in rule["resources"]), rule
            assert "nonResourceURLs" not in rule


def test_operator_verbs_are_exactly_these(documents: list[dict]) -> None:
    granted = verbs(chart.rules(documents, "splitserve"))
    for (group, resource), allowed in sorted(granted.items()):
        print(f"{group or 'core'}/{resource}: {', '.join(sorted(allowed))}")
    assert granted == EXPECTED


def test_the_operator_may_not_read_or_delete_secrets_or_escalate(documents: list[dict]) -> None:
    rules = chart.rules(documents, "splitserve")
    for verb in ("get", "list", "watch", "patch", "delete"):
        assert not chart.allows(rules, "", "secrets", verb)
    for verb in ("escalate", "create", "patch"):
        assert not chart.allows(rules, "rbac.authorization.k8s.io", "clusterroles", verb)
    assert not chart.allows(rules, "rbac.authorization.k8s.io", "clusterroles", "bind", "admin")
    assert chart.allows(
        rules, "rbac.authorization.k8s.io", "clusterroles", "bind", "splitserve-router"
    )
    assert not any("delete" in v or "deletecollection" in v for v in verbs(rules).values())


def test_leader_election_may_renew_only_its_own_lease(documents: list[dict]) -> None:
    rules = chart.rules(documents, "splitserve-leader-election", kind="Role")
    assert verbs(rules) == {("coordination.k8s.io", "leases"): {"create", "get", "patch"}}
    for verb in ("get", "patch"):
        assert chart.allows(rules, "coordination.k8s.io", "leases", verb, "splitserve")
        assert not chart.allows(rules, "coordination.k8s.io", "leases", verb, "kube-scheduler")
    (binding,) = [d for d in documents if d["kind"] == "RoleBinding"]
    assert binding["metadata"]["namespace"] == "splitserve-system"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "splitserve-leader-election"}  # fmt: skip


def test_router_role_is_read_only_discovery(documents: list[dict]) -> None:
    assert verbs(chart.rules(documents, "splitserve-router")) == ROUTER


def test_the_binding_names_the_operator_account(documents: list[dict]) -> None:
    (binding,) = [d for d in documents if d["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "splitserve"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "splitserve", "namespace": "splitserve-system"}
    ]


def test_owner_references_may_block_deletion(documents: list[dict]) -> None:
    """Children carry ``blockOwnerDeletion: true``; where the API server enforces
    owner-reference permissions, that needs update on the owner's finalizers."""
    from splitserve_operator.render.names import ServiceRef

    assert ServiceRef("a", "b", "c").owner_reference()["blockOwnerDeletion"] is True
    rules = chart.rules(documents, "splitserve")
    assert chart.allows(rules, "splitserve.io", "inferenceservices/finalizers", "update")
    assert not chart.allows(rules, "splitserve.io", "inferenceservices", "update")


def test_tenants_get_inferenceservices_through_the_built_in_roles(documents: list[dict]) -> None:
    roles = {
        d["metadata"]["name"]: d
        for d in documents
        if d["kind"] == "ClusterRole" and d["metadata"]["name"].startswith("splitserve-")
    }
    edit, view = roles["splitserve-edit"], roles["splitserve-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "rbac.authorization.k8s.io/aggregate-to-edit" not in view["metadata"]["labels"]
    assert verbs(edit["rules"]) == {
        ("splitserve.io", "inferenceservices"): {
            "get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"
        },
        ("splitserve.io", "inferenceservices/status"): {"get"},  # the operator's to write
        # scaled as a Deployment is (kubectl scale); made and deleted by the operator
        ("splitserve.io", "workerpools"): {"get", "list", "watch", "update", "patch"},
        ("splitserve.io", "workerpools/scale"): {"get", "update", "patch"},
        ("splitserve.io", "workerpools/status"): {"get"},
    }  # fmt: skip
    assert verbs(view["rules"]) == {
        ("splitserve.io", "inferenceservices"): {"get", "list", "watch"},
        ("splitserve.io", "inferenceservices/status"): {"get", "list", "watch"},
        ("splitserve.io", "workerpools"): {"get", "list", "watch"},
        ("splitserve.io", "workerpools/status"): {"get", "list", "watch"},
        ("splitserve.io", "workerpools/scale"): {"get", "list", "watch"},
    }
    off = chart.template(sets=["rbac.aggregate=false"])
    assert not [d for d in off if d["metadata"]["name"] in ("splitserve-edit", "splitserve-view")]
