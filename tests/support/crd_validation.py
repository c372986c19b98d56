"""Check a resource against the CRD the way an API server would, without one.

Test support (needs ``jsonschema`` and ``cel-python`` from the ``test`` extra):

1. defaults from the schema are filled in (``default:`` of absent properties, as
   the API server does before validating);
2. the ``openAPIV3Schema`` is checked with ``jsonschema`` (OpenAPI 3.0 schemas are
   Draft 4 in JSON Schema terms: boolean ``exclusiveMinimum`` and the like);
3. ``x-kubernetes-list-type: map`` keys must be unique;
4. every ``x-kubernetes-validations`` CEL rule is evaluated with ``celpy`` on the
   object it sits on (``type: number`` values as doubles, as the API server gives them).

:func:`problems` returns a list of messages (empty: accepted).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferenceservices.splitserve.io.yaml"


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    with open(path) as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc, dict)
    return doc


def schema_of(crd: Mapping[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return dict(v["schema"]["openAPIV3Schema"])
    raise KeyError(version)


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill ``default:`` values of absent properties, recursively (a new object)."""
    value = copy.deepcopy(value)
    _default_into(schema, value)
    return value


def _default_into(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_into(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for name in value:
                if name not in (schema.get("properties") or {}):
                    _default_into(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _default_into(schema["items"], item)


def _walk(
    schema: Mapping[str, Any], value: Any, path: str
) -> Iterator[tuple[Mapping[str, Any], Any, str]]:
    """Every (schema, value, path) pair where the value exists."""
    yield schema, value, path
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name in value:
                yield from _walk(sub, value[name], f"{path}.{name}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for name, item in value.items():
                if name not in props:
                    yield from _walk(extra, item, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            yield from _walk(schema["items"], item, f"{path}[{i}]")


@cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def as_cel_types(schema: Mapping[str, Any], value: Any) -> Any:
    """``value`` with every ``type: number`` value a float: the API server hands CEL a
    double there even where the JSON says ``90``."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        return {
            k: as_cel_types(props.get(k) or (extra if isinstance(extra, Mapping) else {}), v)
            for k, v in value.items()
        }
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [as_cel_types(schema["items"], v) for v in value]
    return value


def cel_problems(schema: Mapping[str, Any], value: Any, root: str = "") -> list[str]:
    import celpy

    out = []
    for sub, item, path in _walk(schema, value, root):
        for check in sub.get("x-kubernetes-validations") or []:
            typed = as_cel_types(sub, item)
            result = _program(check["rule"]).evaluate({"self": celpy.json_to_cel(typed)})
            if isinstance(result, Exception) or not bool(result):
                out.append(f"{path or '<root>'}: {check.get('message', check['rule'])}")
    return out


def list_map_problems(schema: Mapping[str, Any], value: Any, root: str = "") -> list[str]:
    out = []
    for sub, item, path in _walk(schema, value, root):
        if sub.get("x-kubernetes-list-type") == "map" and isinstance(item, list):
            keys = sub.get("x-kubernetes-list-map-keys") or []
            seen = set()
            for entry in item:
                if isinstance(entry, Mapping):
                    key = tuple(entry.get(k) for k in keys)
                    if key in seen:
                        out.append(
                            f"{path}: duplicate entry with {dict(zip(keys, key, strict=True))}"
                        )
                    seen.add(key)
    return out


def problems(
    resource: Mapping[str, Any],
    crd: Mapping[str, Any] | None = None,
    version: str = "v1alpha1",
) -> list[str]:
    """Why the API server would refuse ``resource`` (empty: it would accept it)."""
    import jsonschema

    schema = schema_of(crd or load_crd(), version)
    value = apply_defaults(schema, resource)
    validator = jsonschema.Draft4Validator(schema)
    out = [
        f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in validator.iter_errors(value)
    ]
    if out:  # as the API server: CEL rules run only on schema-valid objects
        return out
    return list_map_problems(schema, value) + cel_problems(schema, value)
