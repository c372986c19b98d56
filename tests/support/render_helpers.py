"""Rendering an InferenceService for the render tests, and reading the objects back."""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.parse import parse_spec
from splitserve_operator.api.values import WORKER_POOLS, Pool
from splitserve_operator.render.manifests import RenderInputs, render
from splitserve_operator.render.names import ServiceRef
from splitserve_operator.render.replicas import deployment_replicas, pool_target

K8S_VERSION = "1.32"
REF = ServiceRef(name="demo", namespace="team-a", uid="0000-uid")
BASE: dict[str, Any] = {"model": {"name": "smollm2-135m"}, "image": "splitserve/worker:0.1.0"}


def inputs(spec: InferenceServiceSpec, replicas: dict[Pool, int] | None = None) -> RenderInputs:
    """What a first reconcile renders with: new pools at their seed size."""
    plan = replicas or {pool: deployment_replicas(spec, pool, None) for pool in Pool}
    pools = {
        pool: pool_target(spec, pool, exists=False, live=None, recorded=None, ours=False)
        for pool in WORKER_POOLS
    }
    return RenderInputs(replicas=plan, token="secret-token", pools=pools)


def objects(
    changes: dict[str, Any] | None = None,
    replicas: dict[Pool, int] | None = None,
) -> dict[str, dict[str, Any]]:
    raw = copy.deepcopy(BASE)
    for key, value in (changes or {}).items():
        raw[key] = value
    spec = parse_spec(raw, name=REF.name)
    out = render(REF, spec, inputs(spec, replicas))
    return {f"{d.kind}/{d.name}": d.manifest for d in out if not d.existing_only}


def existing_only(changes: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """What render patches only where it already exists (an object turned off)."""
    raw = copy.deepcopy(BASE)
    raw.update(changes or {})
    spec = parse_spec(raw, name=REF.name)
    out = render(REF, spec, inputs(spec))
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


TP_FLAG = "--tensor-parallel-size"


def takes_tensor_parallel(parser: argparse.ArgumentParser, args: list[str]) -> bool:
    """Whether ``parser`` (the worker's own) reads the ``--tensor-parallel-size`` in the
    rendered ``args``; the worker's tensor parallelism may land after the operator's."""
    _, unknown = parser.parse_known_args(args)
    return TP_FLAG not in unknown


def parseable(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """Rendered ``args`` as ``parser`` can read them: without ``--tensor-parallel-size N``
    where the worker does not take it yet (:func:`takes_tensor_parallel`); unchanged
    otherwise, so every other flag is still checked."""
    if TP_FLAG not in args or takes_tensor_parallel(parser, args):
        return args
    at = args.index(TP_FLAG)
    return args[:at] + args[at + 2 :]
