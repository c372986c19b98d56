"""The typed ``InferenceService`` spec: parse once, with errors that say what to fix.

The CRD's schema (``crds/inferenceservices.splitserve.io.yaml``) rejects most bad
input at the API server, but not all of it reaches us validated: Helm never
upgrades a CRD, so an old schema may let new mistakes through, and some rules
(names that must fit in a Service name) are only checked here. Everything the
operator reads from a spec goes through :func:`parse_spec`, which either returns
a frozen :class:`InferenceServiceSpec` or raises :class:`SpecError` listing every
problem as ``spec.path: what is wrong (got VALUE)``.

Pure: no Kubernetes client, no kopf. Field names are the CRD's camelCase on the
wire and snake_case in Python. The models live in :mod:`.models` (their common
base in :mod:`.base`, the engine and router settings in :mod:`.settings`) and the
enums and limits in :mod:`.values`; import each name from the module that defines it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from splitserve_operator.api.deprecations import upgrade
from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.values import MAX_NAME_LENGTH, NAME_PATTERN


class SpecError(ValueError):
    """The spec cannot be served as written. ``problems`` says what to fix, one per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def check_name(name: object) -> list[str]:
    """Problems with an InferenceService's ``metadata.name`` (it names Services)."""
    if not isinstance(name, str) or not name:
        return ["metadata.name: missing"]
    problems = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(
            f"metadata.name: at most {MAX_NAME_LENGTH} characters, so that the derived "
            f"Service names fit in 63 (got {len(name)})"
        )
    if not NAME_PATTERN.match(name):
        problems.append(
            "metadata.name: must be lower-case letters, digits and '-', start with a "
            f"letter and end with a letter or digit (got {name!r})"
        )
    return problems


def _path(loc: Sequence[int | str]) -> str:
    out = "spec"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue
        else:
            out += f".{part}"
    return out


def _describe(error: Mapping[str, Any]) -> str:
    msg = str(error["msg"])
    msg = msg.removeprefix("Value error, ")
    where = _path(error["loc"])
    text = f"{where}: {msg}"
    if error["type"] not in ("missing", "value_error") and "input" in error:
        shown = repr(error["input"])
        if len(shown) > 60:
            shown = shown[:57] + "..."
        text += f" (got {shown})"
    return text


def parse_spec(raw: object, *, name: object = None) -> InferenceServiceSpec:
    """Parse ``.spec`` (and check ``metadata.name`` when given); raise SpecError.

    Deprecated forms are read into the current ones first (:mod:`.deprecations`; their
    warnings come from :func:`~.deprecations.deprecations`)."""
    problems = check_name(name) if name is not None else []
    spec: InferenceServiceSpec | None = None
    if not isinstance(raw, Mapping):
        problems.append(f"spec: must be an object (got {type(raw).__name__})")
    else:
        upgraded = upgrade(raw)
        problems.extend(upgraded.problems)
        try:
            # JSON mode: the input is what came over the wire (enums as strings, strict
            # numbers and booleans).
            spec = InferenceServiceSpec.model_validate_json(
                json.dumps(upgraded.spec), by_alias=True
            )
        except ValidationError as exc:
            problems.extend(_describe(err) for err in exc.errors())
    if problems or spec is None:
        raise SpecError(problems)
    return spec
