"""Check a rendered manifest the way the API server would, offline (test support).

Built-in kinds with ``kubernetes-validate --strict`` (the Kubernetes OpenAPI schemas it
ships); the Gateway API's HTTPRoute against its published CRD (``schemas/``), with the
same schema and CEL checks :mod:`crd_validation` makes of our own CRD.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
from crd_validation import problems

K8S_VERSION = "1.32"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRDS = {
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): (
        "gateway.networking.k8s.io_httproutes.json",
        "v1",
    ),
}
"""Kinds checked against a published CRD: file in ``schemas/`` and version."""


@cache
def _crd(name: str) -> dict[str, Any]:
    doc = json.loads((SCHEMAS / name).read_text())
    assert isinstance(doc, dict)
    return doc


def manifest_problems(manifest: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse ``manifest`` (empty: it would accept it)."""
    key = (str(manifest.get("apiVersion")), str(manifest.get("kind")))
    if key in CRDS:
        name, version = CRDS[key]
        return problems(manifest, _crd(name), version)
    try:
        kubernetes_validate.validate(dict(manifest), K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{key[1]}: {exc}"]
    return []
