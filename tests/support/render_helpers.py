"""Rendering an InferenceService for the render tests, and reading the objects back."""

from __future__ import annotations

import copy
import json
from typing import Any

from splitserve_operator.api.parse import parse_spec
from splitserve_operator.api.values import Pool
from splitserve_operator.render.manifests import RenderInputs, render
from splitserve_operator.render.names import ServiceRef
from splitserve_operator.render.replicas import plan_replicas

K8S_VERSION = "1.32"
REF = ServiceRef(name="demo", namespace="team-a", uid="0000-uid")
BASE: dict[str, Any] = {"model": {"name": "smollm2-135m"}, "image": "splitserve/worker:0.1.0"}


def objects(
    changes: dict[str, Any] | None = None,
    replicas: dict[Pool, int] | None = None,
) -> dict[str, dict[str, Any]]:
    raw = copy.deepcopy(BASE)
    for key, value in (changes or {}).items():
        raw[key] = value
    spec = parse_spec(raw, name=REF.name)
    plan = replicas or {pool: plan_replicas(spec, pool) for pool in Pool}
    out = render(REF, spec, RenderInputs(replicas=plan, token="secret-token"))
    return {f"{d.kind}/{d.name}": d.manifest for d in out if not d.existing_only}


def existing_only(changes: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """What render patches only where it already exists (an object turned off)."""
    raw = copy.deepcopy(BASE)
    raw.update(changes or {})
    spec = parse_spec(raw, name=REF.name)
    plan = {pool: plan_replicas(spec, pool) for pool in Pool}
    out = render(REF, spec, RenderInputs(replicas=plan, token="secret-token"))
    return {f"{d.kind}/{d.name}": d.manifest for d in out if d.existing_only}


def pod(objs: dict[str, dict[str, Any]], pool: str) -> dict[str, Any]:
    return objs[f"Deployment/demo-{pool}"]["spec"]["template"]["spec"]


def container(objs: dict[str, dict[str, Any]], pool: str) -> dict[str, Any]:
    return pod(objs, pool)["containers"][0]


def arg(objs: dict[str, dict[str, Any]], pool: str, flag: str) -> str:
    args = container(objs, pool)["args"]
    return str(args[args.index(flag) + 1])


def env(objs: dict[str, dict[str, Any]], pool: str) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(objs, pool)["env"]}


def config(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return json.loads(objs["ConfigMap/demo-config"]["data"]["splitserve.json"])
