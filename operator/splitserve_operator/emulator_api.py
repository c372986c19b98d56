"""The emulated API's surface and shared pieces: the resources discovery announces,
the record of one served request, faults, and the RFC 7386 merge patch.

Test support for :mod:`splitserve_operator.emulator` (see there for what it emulates).
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kmock
from kmock._internal.rendering import Request  # the parsed request handed to _handle

Fault = Callable[[Request], "kmock.KubernetesError | None"]

HISTORY = 1
"""Requests kept in kmock's own history (see ``KubeEmulator._handle``)."""

ALL_VERBS = ("get", "list", "watch", "create", "patch", "update", "delete", "deletecollection")

RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "v1/events": {"kind": "Event"},
    "v1/pods": {"kind": "Pod", "subresources": {"status"}},
    "v1/services": {"kind": "Service", "subresources": {"status"}},
    "v1/configmaps": {"kind": "ConfigMap"},
    "v1/secrets": {"kind": "Secret"},
    "v1/serviceaccounts": {"kind": "ServiceAccount"},
    "apps/v1/deployments": {"kind": "Deployment", "subresources": {"status", "scale"}},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding"},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy"},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "subresources": {"status"}},
    "events.k8s.io/v1/events": {"kind": "Event"},
    "splitserve.io/v1alpha1/inferenceservices": {
        "kind": "InferenceService",
        "singular": "inferenceservice",
        "shortnames": {"sisvc"},
        "subresources": {"status"},
    },
}
"""What discovery announces: the operator's kinds, and ``v1/namespaces`` (kopf hangs
without it)."""


@dataclass(frozen=True)
class Seen:
    """One request the emulator served."""

    method: str
    path: str
    action: str | None
    subresource: str | None
    watch: bool
    agent: str = ""
    """The client's User-Agent (the operator's: ``splitserve-operator/...`` and ``kopf/...``)."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _essence(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}
