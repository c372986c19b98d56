"""Three-way JSON merge patches, as ``kubectl apply`` makes them. Pure.

``desired`` is what render wants now, ``last`` what the operator applied before
(kept in the ``splitserve.io/last-applied`` annotation), ``actual`` what the API
server has. The patch:

- sets every desired field whose live value differs (drift, or a spec change);
- removes (``null``) fields the operator set before and no longer wants;
- leaves alone everything else: fields the server defaulted, labels and
  annotations others added.

Lists are atomic in a JSON merge patch, so a list is replaced whole when it
differs; it "matches" when it has the same length and each desired item
matches the live one (the live item may carry server defaults).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from splitserve_operator.render.names import ANNOTATION_LAST_APPLIED


def matches(desired: Any, actual: Any) -> bool:
    """Whether ``actual`` already satisfies ``desired`` (extra keys in actual are fine)."""
    if isinstance(desired, Mapping):
        if not isinstance(actual, Mapping):
            return not desired and actual is None
        return all(matches(value, actual.get(key)) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return not desired and actual is None
        return all(matches(d, a) for d, a in zip(desired, actual, strict=True))
    if isinstance(desired, bool) or isinstance(actual, bool):
        return desired is actual
    if isinstance(desired, int | float) and isinstance(actual, int | float):
        return desired == actual
    return bool(desired == actual)


def three_way(
    last: Mapping[str, Any] | None, desired: Mapping[str, Any], actual: Mapping[str, Any]
) -> dict[str, Any]:
    """The merge patch that takes ``actual`` to ``desired`` (empty when nothing to do)."""
    last = last or {}
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        have = actual.get(key)
        if isinstance(want, Mapping) and isinstance(have, Mapping):
            before = last.get(key)
            sub = three_way(before if isinstance(before, Mapping) else None, want, have)
            if sub:
                patch[key] = sub
        elif not matches(want, have):
            patch[key] = want
    for key in last:
        if key not in desired and key in actual:
            patch[key] = None
    return patch


def last_applied(actual: Mapping[str, Any]) -> dict[str, Any] | None:
    """The manifest recorded on ``actual`` by the last apply, if readable."""
    annotations = (actual.get("metadata") or {}).get("annotations") or {}
    text = annotations.get(ANNOTATION_LAST_APPLIED)
    if not isinstance(text, str):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def with_last_applied(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` plus the annotation that records it (for create and patch)."""
    recorded = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    out = dict(manifest)
    metadata = dict(out.get("metadata") or {})
    annotations = dict(metadata.get("annotations") or {})
    annotations[ANNOTATION_LAST_APPLIED] = recorded
    metadata["annotations"] = annotations
    out["metadata"] = metadata
    return out


def apply_patch(manifest: Mapping[str, Any], actual: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch for ``actual`` so it matches ``manifest`` and records it."""
    desired = with_last_applied(manifest)
    return three_way(last_applied(actual), desired, actual)
