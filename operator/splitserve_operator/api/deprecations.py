"""The spec's deprecated forms, and their conversion to the current ones.

v1alpha1 first wrote durations as float seconds (``slo.ttftSeconds: 0.5``) and shares
as fractions (``slo.percentile: 0.9``, ``engine.gpuMemoryFraction: 0.85``). The API now
takes duration strings (``slo.ttft: 500ms``) and whole percents (``percentile: 90``).
For one version the old forms are still read: :func:`upgrade` checks each old value
against the bounds it always had, converts it to the new field, and says so in a
warning (the operator puts them in ``status.warnings`` and an Event). A spec that sets
both the old and the new field of a pair is refused.

Pure: raw spec dictionaries in, a converted copy, warnings and problems out.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from splitserve_operator.api.durations import format_duration


def _to_duration(value: Any) -> str:
    return format_duration(float(value))


def _to_percent(value: Any) -> int:
    return max(1, min(99, round(float(value) * 100)))


def _to_memory_percent(value: Any) -> int:
    return max(1, min(100, round(float(value) * 100)))


def _as_is(value: Any) -> Any:
    return value


_PERCENTS = (_to_percent, _to_memory_percent)


@dataclass(frozen=True)
class Rename:
    """An old field of ``section`` read into ``new`` through ``convert``, after checking
    it against ``old_type`` (its bounds when it was current)."""

    section: tuple[str, ...]
    old: str
    new: str
    old_type: Any
    convert: Callable[[Any], Any]
    applies: Callable[[Any], bool] = field(default=lambda _value: True)
    """For a field that kept its name and changed its form: whether a value is the old form."""

    @property
    def adapter(self) -> TypeAdapter[Any]:
        return TypeAdapter(self.old_type)


def _float(*, gt: float, le: float) -> Any:
    return Annotated[float, Field(strict=True, gt=gt, le=le)]


def _int(*, ge: int, le: int) -> Any:
    return Annotated[int, Field(strict=True, ge=ge, le=le)]


def _fraction_form(value: Any) -> bool:
    """``percentile: 0.9`` is the old form; a whole number is a percent."""
    return isinstance(value, float) and 0 < value < 1


_POOLS = ("prefill", "decode", "flex", "router")
_TIMEOUTS = ("connect", "prefill", "firstToken", "interToken", "request")

RENAMES: tuple[Rename, ...] = (
    Rename(("slo",), "ttftSeconds", "ttft", _float(gt=0, le=600), _to_duration),
    Rename(("slo",), "tpotSeconds", "tpot", _float(gt=0, le=60), _to_duration),
    Rename(
        ("slo",),
        "percentile",
        "percentile",
        Annotated[float, Field(strict=True, gt=0, lt=1)],
        _to_percent,
        applies=_fraction_form,
    ),
    Rename(("kvTransfer",), "leaseSeconds", "lease", _int(ge=1, le=3600), _to_duration),
    Rename(("autoscaling",), "intervalSeconds", "interval", _int(ge=5, le=3600), _to_duration),
    *(
        Rename(
            (pool, "engine"),
            "gpuMemoryFraction",
            "gpuMemoryPercent",
            _float(gt=0, le=1),
            _to_memory_percent,
        )
        for pool in ("prefill", "decode", "flex")
    ),
    Rename(
        ("router", "settings", "queues"),
        "maxWaitSeconds",
        "maxWait",
        _float(gt=0, le=3600),
        _to_duration,
    ),
    Rename(
        ("router", "settings", "queues"),
        "retryAfterSeconds",
        "retryAfter",
        _int(ge=1, le=3600),
        _to_duration,
    ),
    *(
        Rename(
            ("router", "settings", "timeouts"),
            f"{name}Seconds",
            name,
            _float(gt=0, le=86_400),
            _to_duration,
        )
        for name in _TIMEOUTS
    ),
    Rename(
        ("router", "settings", "timeouts"),
        "healthIntervalSeconds",
        "healthInterval",
        _float(gt=0, le=600),
        _to_duration,
    ),
    *(
        Rename(
            (pool,),
            "podAnnotations",
            "podTemplate.annotations",
            dict[str, Any],
            _as_is,
        )
        for pool in _POOLS
    ),
)
"""Every deprecated form the operator still reads, and where it goes."""


@dataclass
class Upgraded:
    """What :func:`upgrade` made of a raw spec."""

    spec: Any
    """A copy in the current form (the input itself when it is not an object)."""
    warnings: list[str] = field(default_factory=list)
    """One line per deprecated field read: what it was read as, and what to write."""
    problems: list[str] = field(default_factory=list)
    """Old values out of their bounds, and pairs set twice."""


def _section(spec: Any, path: tuple[str, ...]) -> dict[str, Any] | None:
    node = spec
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node if isinstance(node, dict) else None


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | int | float) else "{...}"


def _describe(path: str, error: ValidationError) -> str:
    first = error.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{path}: {message} (got {first.get('input')!r})"


def upgrade(raw: Any) -> Upgraded:
    """``raw`` (a spec as it came from the API) with every deprecated field read into its
    new form."""
    if not isinstance(raw, Mapping):
        return Upgraded(spec=raw)
    spec = copy.deepcopy(dict(raw))
    out = Upgraded(spec=spec)
    for rename in RENAMES:
        section = _section(spec, rename.section)
        if section is None or rename.old not in section:
            continue
        value = section[rename.old]
        if not rename.applies(value):
            continue
        where = ".".join(("spec", *rename.section))
        old_path = f"{where}.{rename.old}"
        new_path = f"{where}.{rename.new}"
        *parents, leaf = rename.new.split(".")
        target: dict[str, Any] = section
        for key in parents:
            inner = target.get(key)
            target = inner if isinstance(inner, dict) else {}
        del section[rename.old]  # reported below if it cannot be read, never twice
        if rename.old != rename.new and leaf in target:
            out.problems.append(
                f"{where}: set {rename.new} or the deprecated {rename.old}, not both"
            )
            continue
        try:
            rename.adapter.validate_python(value)
        except ValidationError as exc:
            out.problems.append(_describe(old_path, exc))
            continue
        new = rename.convert(value)
        holder = section
        for key in parents:
            holder = holder.setdefault(key, {})
        holder[leaf] = new
        if rename.old == rename.new:
            message = f"{old_path}: a fraction ({value!r}) is deprecated: write the percent, {new}"
        else:
            message = f"{old_path} is deprecated: write {new_path}: {_shown(new)} instead"
        if rename.convert in _PERCENTS and abs(float(value) * 100 - new) > 1e-6:
            message += f" ({value!r} is read as {new}: percents are whole numbers)"
        out.warnings.append(message)
    return out


def deprecations(raw: Any) -> list[str]:
    """The warnings for the deprecated fields a raw spec uses (empty: none)."""
    return upgrade(raw).warnings
