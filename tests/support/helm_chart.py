"""The Helm chart, rendered by the real ``helm`` binary (test support).

``helm`` is looked up in the virtual environment's ``bin/`` (where
``.ci/install-tools.sh`` puts it) and then on ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "splitserve"


def find_helm() -> str | None:
    local = Path(sys.prefix) / "bin" / "helm"
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    repo_venv = ROOT / ".venv" / "bin" / "helm"
    if repo_venv.exists() and os.access(repo_venv, os.X_OK):
        return str(repo_venv)
    return shutil.which("helm")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = find_helm()
    if binary is None:
        raise FileNotFoundError("helm is not installed (bash .ci/install-tools.sh .venv)")
    return subprocess.run([binary, *args], capture_output=True, text=True, check=check, timeout=120)


def template(
    values: Mapping[str, Any] | None = None,
    *,
    sets: Sequence[str] = (),
    release: str = "splitserve",
    namespace: str = "splitserve-system",
    include_crds: bool = False,
) -> list[dict[str, Any]]:
    """``helm template`` the chart and return its documents."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    for item in sets:
        args += ["--set", item]
    if values:
        path = ROOT / ".pytest_cache" / f"values-{os.getpid()}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump(dict(values)))
        args += ["--values", str(path)]
    out = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def rules(
    documents: Sequence[Mapping[str, Any]], name: str, kind: str = "ClusterRole"
) -> list[dict[str, Any]]:
    """The rules of the ClusterRole (or ``kind``: a Role) called ``name``."""
    for doc in documents:
        if doc.get("kind") == kind and doc["metadata"]["name"] == name:
            return list(doc.get("rules") or [])
    raise KeyError(f"no {kind} {name}")


def allows(
    role_rules: Sequence[Mapping[str, Any]],
    group: str,
    resource: str,
    verb: str,
    name: str | None = None,
) -> bool:
    """Whether RBAC ``role_rules`` allow ``verb`` on ``group``/``resource`` (as the API
    server decides: every field matches, resourceNames restrict by object name)."""
    for rule in role_rules:
        if group not in rule.get("apiGroups", []) or resource not in rule.get("resources", []):
            continue
        if verb not in rule.get("verbs", []):
            continue
        names = rule.get("resourceNames")
        if names and name not in names:
            continue
        return True
    return False


def api_calls(
    paths: Sequence[tuple[str, str, bool]],
) -> Iterator[tuple[str, str, str, str | None, str | None]]:
    """(group, resource[/subresource], verb, namespace, name) for each (method, path, watch)
    served, skipping discovery (non-resource URLs every authenticated client may read)."""
    for method, path, watch in paths:
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) > 2:
            group, rest = "", parts[2:]
        elif parts[0] == "apis" and len(parts) > 3:
            group, rest = parts[1], parts[3:]
        else:
            continue  # /api, /apis, /api/v1, /apis/<group>/<version>: discovery
        namespace = None
        if rest[0] == "namespaces" and len(rest) > 2:
            namespace, rest = rest[1], rest[2:]
        resource = rest[0]
        named = len(rest) > 1
        if len(rest) > 2:
            resource += "/" + rest[2]
        verb = {
            "GET": ("watch" if watch else "get" if named else "list"),
            "POST": "create",
            "PATCH": "patch",
            "PUT": "update",
            "DELETE": "delete",
        }[method]
        yield group, resource, verb, namespace, rest[1] if named else None


def owner_reference_calls(
    objects: Sequence[Mapping[str, Any]], plurals: Mapping[str, str]
) -> Iterator[tuple[str, str, str]]:
    """(group, resource/finalizers, "update") that the API server's
    OwnerReferencesPermissionEnforcement asks of whoever writes each of ``objects``: an
    owner reference with ``blockOwnerDeletion: true`` needs update on the owner's
    finalizers. ``plurals``: kind to resource name, for the owners' kinds."""
    for obj in objects:
        for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("blockOwnerDeletion"):
                group = str(ref["apiVersion"]).rpartition("/")[0]
                yield group, f"{plurals[ref['kind']]}/finalizers", "update"
