"""The pods of a service's ``spec.flex`` as the autoscaling loop sees and switches them.

A switchable pod's role is its ``splitserve.io/role`` label, nothing else: the worker
reads it from its downward-API labels file and switches itself (draining first) when
it changes. So the loop

- reads the pods of ``<name>-flex`` (by the Deployment's selector) and counts the
  split from their labels (:func:`split_of`; a pod not Ready, being deleted, or with a
  label that names no role is counted as switching: the policy holds while one is);
- applies a switch by a server-side apply of that one label on one pod
  (:func:`relabel`), under the planner's field manager. The Deployment's template
  keeps ``both``: a replacement pod starts colocated and is switched again by the
  planner if the load asks for it; a restarted container reads its pod's label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.role_balance import Split
from splitserve.roles import Role

from splitserve_operator.api.fields import as_map
from splitserve_operator.api.values import FLEX_COMPONENT
from splitserve_operator.control.k8s import PLANNER, POD, Cluster
from splitserve_operator.render.commands import ROLE_LABEL
from splitserve_operator.render.names import LABEL_COMPONENT, LABEL_INSTANCE


@dataclass(frozen=True)
class FlexPod:
    name: str
    role: Role | None
    """The role its label names; None: no label, or one that names no role."""
    ready: bool
    """Ready and not being deleted: it serves its role now."""


def selector(name: str) -> str:
    """The label selector of ``<name>-flex``'s pods (the Deployment's own)."""
    return f"{LABEL_INSTANCE}={name},{LABEL_COMPONENT}={FLEX_COMPONENT}"


def _pod(body: Mapping[str, Any]) -> FlexPod:
    meta = as_map(body.get("metadata"))
    label = as_map(meta.get("labels")).get(ROLE_LABEL)
    try:
        role: Role | None = Role(str(label))
    except ValueError:
        role = None
    conditions = as_map(body.get("status")).get("conditions") or []
    ready = any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )
    return FlexPod(str(meta.get("name") or ""), role, ready and not meta.get("deletionTimestamp"))


def flex_pods(cluster: Cluster, namespace: str, name: str) -> list[FlexPod]:
    """The service's switchable pods, by name. Raises the cluster's ApiError."""
    bodies = cluster.list(POD, namespace, selector(name))
    return sorted((_pod(b) for b in bodies), key=lambda p: p.name)


def split_of(pods: Sequence[FlexPod], fixed_prefill: int, fixed_decode: int) -> Split:
    """The split the policy decides on: serving pods per role, the rest switching."""
    serving = [p for p in pods if p.ready and p.role is not None]
    count = {role: sum(1 for p in serving if p.role is role) for role in Role}
    return Split(
        prefill=count[Role.PREFILL],
        decode=count[Role.DECODE],
        both=count[Role.BOTH],
        switching=len(pods) - len(serving),
        fixed_prefill=fixed_prefill,
        fixed_decode=fixed_decode,
    )


def pick(pods: Sequence[FlexPod], role: Role) -> FlexPod | None:
    """The pod that switches away from ``role``: the first serving one by name (a
    stable choice, so a retried switch after a failed write picks the same pod)."""
    return next((p for p in pods if p.ready and p.role is role), None)


def relabel(cluster: Cluster, namespace: str, pod: str, role: Role) -> None:
    """Set ``pod``'s role label to ``role`` (the worker follows it). Raises ApiError."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod, "namespace": namespace, "labels": {ROLE_LABEL: role.value}},
    }
    cluster.apply(manifest, field_manager=PLANNER, force=True)
