"""What a field manager owns of a live object, and whether applying a manifest again
would change anything. Pure (dicts in, answers out); the reconciler and the autoscaling
loop use it to send an apply only when one is due.

The API server records, in ``metadata.managedFields``, the fields each manager set (its
``FieldsV1`` tree: ``f:name`` a field, ``k:{...}`` an item of a list keyed by some of its
fields, ``.`` the node itself). :func:`owned` cuts the live object down to what one
manager's apply entry owns (what client-go's ``Extract...`` functions return): a field
another writer changed has moved to that writer and is missing here, a value the server
rewrote (a quantity in canonical form) is here as stored. :func:`needs_apply` then compares
that with the manifest, quantities by value, so ``nvidia.com/gpu: 1`` matches the stored
``"1"`` and ``1024Mi`` matches ``1Gi``: drift is what field ownership says it is, and an
unchanged object costs no write.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from splitserve_operator.api.fields import as_map
from splitserve_operator.api.values import quantity_value

APPLY = "Apply"
UPDATE = "Update"

LEGACY_ANNOTATION = "splitserve.io/last-applied"
"""Where operator versions before server-side apply kept the manifest they last merged."""

IDENTITY_FIELDS = ("apiVersion", "kind")
IDENTITY_METADATA = ("name", "namespace")
"""Part of every applied manifest, never recorded as owned: not compared."""


def _entries(
    live: Mapping[str, Any], manager: str, subresource: str | None
) -> list[Mapping[str, Any]]:
    out = []
    for entry in as_map(live.get("metadata")).get("managedFields") or []:
        entry = as_map(entry)
        if (
            entry.get("manager") == manager
            and entry.get("operation") == APPLY
            and (entry.get("subresource") or None) == subresource
        ):
            out.append(entry)
    return out


def _merge_trees(trees: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tree in trees:
        for key, child in tree.items():
            out[key] = _merge_trees([out.get(key, {}), as_map(child)])
    return out


def _matches(item: Any, key: Mapping[str, Any]) -> bool:
    return isinstance(item, Mapping) and all(item.get(k) == v for k, v in key.items())


def _cut(value: Any, tree: Mapping[str, Any]) -> Any:
    children = {k: v for k, v in tree.items() if k != "."}
    if not children:
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, child in children.items():
            kind, _, name = key.partition(":")
            if kind == "f" and name in value:
                out[name] = _cut(value[name], as_map(child))
        return out
    if isinstance(value, list):
        items = []
        for key, child in children.items():
            kind, _, raw = key.partition(":")
            if kind != "k":
                continue
            wanted = json.loads(raw)
            for index, item in enumerate(value):
                if _matches(item, wanted):
                    items.append((index, _cut(item, as_map(child))))
                    break
        return [item for _, item in sorted(items, key=lambda pair: pair[0])]
    return value


def owned(
    live: Mapping[str, Any], manager: str, subresource: str | None = None
) -> dict[str, Any] | None:
    """The part of ``live`` that ``manager``'s apply entry (for ``subresource``) owns;
    None when that manager never applied to it."""
    entries = _entries(live, manager, subresource)
    if not entries:
        return None
    tree = _merge_trees([as_map(e.get("fieldsV1")) for e in entries])
    cut = _cut(live, tree)
    return dict(cut) if isinstance(cut, Mapping) else {}


def owners(live: Mapping[str, Any], path: Sequence[str]) -> list[str]:
    """The managers (any operation) that own the field at ``path`` (field names)."""
    out = set()
    for entry in as_map(live.get("metadata")).get("managedFields") or []:
        node = as_map(as_map(entry).get("fieldsV1"))
        for name in path:
            if f"f:{name}" not in node:
                break
            node = as_map(node[f"f:{name}"])
        else:
            out.add(str(as_map(entry).get("manager")))
    return sorted(out)


def _is_quantity_field(path: tuple[str, ...]) -> bool:
    return (len(path) >= 3 and path[-3] == "resources" and path[-2] in ("requests", "limits")) or (
        bool(path) and path[-1] == "sizeLimit"
    )


def _same(want: Any, have: Any, path: tuple[str, ...]) -> bool:
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return False
        keys = {k for k, v in want.items() if v is not None}
        return keys == set(have) and all(_same(want[k], have[k], (*path, str(k))) for k in keys)
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return False
        if all(_same(w, h, path) for w, h in zip(want, have, strict=True)):
            return True
        # list-map items may come back in another order
        left = list(have)
        for w in want:
            match = next((i for i, h in enumerate(left) if _same(w, h, path)), None)
            if match is None:
                return False
            left.pop(match)
        return True
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have
    if want == have and type(want) is type(have):
        return True
    if _is_quantity_field(path):
        try:
            return quantity_value(want) == quantity_value(have)
        except ValueError:
            return False
    return isinstance(want, int | float) and isinstance(have, int | float) and want == have


def _comparable(manifest: Mapping[str, Any], status_only: bool) -> dict[str, Any]:
    if status_only:
        return {"status": manifest.get("status")} if "status" in manifest else {}
    out = {k: v for k, v in manifest.items() if k not in IDENTITY_FIELDS and k != "status"}
    meta = {k: v for k, v in as_map(out.get("metadata")).items() if k not in IDENTITY_METADATA}
    if meta:
        out["metadata"] = meta
    else:
        out.pop("metadata", None)
    return out


def needs_apply(
    manifest: Mapping[str, Any],
    live: Mapping[str, Any] | None,
    manager: str,
    subresource: str | None = None,
) -> bool:
    """Whether applying ``manifest`` as ``manager`` would change ``live``: it is absent,
    the manager never applied to it, or what the manager owns differs from the manifest
    (a field changed, taken by another writer, added or no longer wanted)."""
    if live is None:
        return True
    mine = owned(live, manager, subresource)
    if mine is None:
        return True
    want = _comparable(manifest, status_only=subresource == "status")
    have = _comparable(mine, status_only=subresource == "status")
    return not _same(want, have, ())


def upgrade_patch(live: Mapping[str, Any], manager: str) -> list[dict[str, Any]] | None:
    """For an object an older operator version wrote with merge patches (its fields
    recorded under ``manager`` as an Update, its manifest in :data:`LEGACY_ANNOTATION`): a
    JSON patch that makes those fields ``manager``'s applied ones, as kubectl's
    ``csaupgrade`` does. The next apply then removes what the spec no longer asks for,
    the annotation included. None when there is nothing to upgrade."""
    meta = as_map(live.get("metadata"))
    if LEGACY_ANNOTATION not in as_map(meta.get("annotations")):
        return None
    entries = [dict(as_map(e)) for e in meta.get("managedFields") or []]
    legacy = [
        e
        for e in entries
        if e.get("manager") == manager and e.get("operation") == UPDATE and not e.get("subresource")
    ]
    if not legacy:
        return None
    applied = [e for e in entries if e.get("manager") == manager and e.get("operation") == APPLY
               and not e.get("subresource")]  # fmt: skip
    merged = dict(applied[0] if applied else legacy[0])
    merged["operation"] = APPLY
    merged["fieldsV1"] = _merge_trees([as_map(e.get("fieldsV1")) for e in legacy + applied])
    kept = [e for e in entries if e not in legacy and e not in applied]
    return [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")},
        {"op": "replace", "path": "/metadata/managedFields", "value": [*kept, merged]},
    ]
