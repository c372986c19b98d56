"""Field ownership as an API server keeps it (server-side apply), in its simplest
faithful form. Pure: dicts in, dicts out; :mod:`kube_emulator` serves it over HTTP and
unit tests drive it directly.

What it models (structured-merge-diff, as kube-apiserver runs it):

- A *field set* is the set of paths an object sets: each scalar, each atomic list
  (replaced whole), each empty map, and each item of an associative list (a "list-map"
  such as ``containers`` keyed by ``name``) with its own fields. Which lists are
  list-maps, and by which keys, comes from :class:`ListTypes`: the built-in kinds' from a
  table, a custom resource's from its CRD schema (``x-kubernetes-list-type: map``).
- ``metadata.managedFields`` records, per (manager, operation, subresource), the fields
  that manager owns, in the server's ``FieldsV1`` encoding (``f:name``, ``k:{...}``,
  ``.``).
- **Apply** (:func:`apply`): the applied configuration is merged into the live object
  (list-maps item by item); a field another manager owns with a different value is a
  conflict (409) unless ``force``, which takes it; fields this manager applied before
  and no longer applies are removed unless another manager still owns them; the
  manager then owns exactly what it applied.
- **Update** (:func:`record_update`; create, merge/JSON patch, PUT, ``/scale``): the
  writer takes every field whose value it changed (ownership moves, never conflicts);
  fields that no longer exist leave every set.

Not modelled: ``v:`` sets, ``i:`` indices, apply to a list-map with duplicate keys,
multiple API versions.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Element = tuple[str, str]
"""One step of a path: ``("f", field name)`` or ``("k", '{"name":"x"}')`` (a list-map item)."""
Path = tuple[Element, ...]

APPLY = "Apply"
UPDATE = "Update"

UNTRACKED_METADATA = frozenset(
    {
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "managedFields",
        "selfLink",
    }
)
"""Server-set or identifying metadata: no manager owns it."""

_MISSING = object()

BUILTIN_LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "volumes": ("name",),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
    "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
    "resourceClaims": ("name",),
    "hostAliases": ("ip",),
}
"""List-maps of the built-in kinds by field name (``ports`` is decided by its items);
every other list is atomic (``args``, ``tolerations``, ``ingress``, ``subjects`` ...)."""

KEY_DEFAULTS = {"protocol": "TCP"}
"""Key fields the server defaults before it keys an item (a port without ``protocol``)."""


class ApplyConflict(Exception):
    """An apply would change fields other managers own: 409 unless forced."""

    def __init__(self, conflicts: Sequence[tuple[str, Path]]) -> None:
        self.conflicts = list(conflicts)
        lines = [f'conflict with "{manager}": {dotted(path)}' for manager, path in conflicts]
        super().__init__(f"Apply failed with {len(lines)} conflicts: {'; '.join(lines)}")


class InvalidApply(ValueError):
    """An applied configuration the server refuses (422)."""


def dotted(path: Path) -> str:
    out = ""
    for kind, value in path:
        out += f".{value}" if kind == "f" else f"[{value}]"
    return out


@dataclass(frozen=True)
class ListTypes:
    """Which lists are list-maps, and their keys."""

    crd_keys: Mapping[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)
    """For a custom resource: field-name path (list items skipped) -> keys, from its
    schema. When set, only these lists are list-maps (a CRD's lists are atomic unless
    its schema says otherwise)."""
    builtin: bool = True

    def keys(self, path: Path, items: Sequence[Any]) -> tuple[str, ...] | None:
        names = tuple(value for kind, value in path if kind == "f")
        if not names:
            return None
        if not self.builtin:
            return tuple(self.crd_keys[names]) if names in self.crd_keys else None
        name = names[-1]
        if name == "ports":
            first = items[0] if items and isinstance(items[0], Mapping) else {}
            return (
                ("containerPort", "protocol") if "containerPort" in first else ("port", "protocol")
            )
        return BUILTIN_LIST_KEYS.get(name)


def item_key(item: Any, keys: Sequence[str]) -> str:
    if not isinstance(item, Mapping):
        raise InvalidApply(f"an item of a list keyed by {list(keys)} must be an object")
    picked: dict[str, Any] = {}
    for key in keys:
        if key in item:
            picked[key] = item[key]
        elif key in KEY_DEFAULTS:
            picked[key] = KEY_DEFAULTS[key]
        else:
            raise InvalidApply(f"an item of a list keyed by {list(keys)} lacks {key!r}")
    return json.dumps(picked, sort_keys=True, separators=(",", ":"))


# -- field sets --------------------------------------------------------------------------


def tracked(obj: Mapping[str, Any], *, status_only: bool, has_status: bool) -> dict[str, Any]:
    """The part of ``obj`` managers can own: no apiVersion/kind, no server metadata;
    for a ``/status`` write only ``status``, for a main write of a kind with a status
    subresource everything but ``status``. Shares ``obj``'s values: read it, don't change it."""
    if status_only:
        return {"status": obj["status"]} if "status" in obj else {}
    out = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    if has_status:
        out.pop("status", None)
    meta = {k: v for k, v in (out.get("metadata") or {}).items() if k not in UNTRACKED_METADATA}
    if meta:
        out["metadata"] = meta
    else:
        out.pop("metadata", None)
    return out


def fieldset(value: Any, types: ListTypes, path: Path = ()) -> set[Path]:
    out: set[Path] = set()
    if isinstance(value, Mapping):
        if not value and path:
            out.add(path)
        for key, child in value.items():
            if child is not None:
                out |= fieldset(child, types, (*path, ("f", str(key))))
    elif isinstance(value, list):
        keys = types.keys(path, value) if value else None
        if keys is None:
            out.add(path)
        else:
            for item in value:
                item_path = (*path, ("k", item_key(item, keys)))
                out.add(item_path)
                out |= fieldset(item, types, item_path)
    elif path:
        out.add(path)
    return out


def value_at(obj: Any, path: Path, types: ListTypes) -> Any:
    node = obj
    walked: Path = ()
    for kind, value in path:
        if kind == "f":
            if not isinstance(node, Mapping) or value not in node:
                return _MISSING
            node = node[value]
        else:
            keys = types.keys(walked, node) if isinstance(node, list) and node else None
            if keys is None:
                return _MISSING
            match = [i for i in node if _key_or_none(i, keys) == value]
            if not match:
                return _MISSING
            node = match[0]
        walked = (*walked, (kind, value))
    return node


def _key_or_none(item: Any, keys: Sequence[str]) -> str | None:
    try:
        return item_key(item, keys)
    except InvalidApply:
        return None


def _is_leaf(obj: Any, path: Path, types: ListTypes) -> bool:
    """A path whose value is compared whole (not a list-map item, not a non-empty map)."""
    if path and path[-1][0] == "k":
        return False
    value = value_at(obj, path, types)
    return not (isinstance(value, Mapping) and value)


def _delete(obj: dict[str, Any], path: Path, types: ListTypes) -> None:
    parent = value_at(obj, path[:-1], types) if len(path) > 1 else obj
    kind, value = path[-1]
    if kind == "f" and isinstance(parent, dict):
        parent.pop(value, None)
    elif kind == "k" and isinstance(parent, list):
        keys = types.keys(path[:-1], parent)
        if keys is not None:
            parent[:] = [i for i in parent if _key_or_none(i, keys) != value]


def _prune(obj: dict[str, Any], path: Path, types: ListTypes, owned: set[Path]) -> None:
    """Drop maps and lists left empty by a removal, up the path, unless someone owns them."""
    for depth in range(len(path) - 1, 0, -1):
        parent_path = path[:depth]
        if parent_path[-1][0] != "f" or parent_path in owned:
            return
        value = value_at(obj, parent_path, types)
        if value in ({}, []):
            _delete(obj, parent_path, types)
        else:
            return


# -- managedFields encoding ----------------------------------------------------------------


def encode(paths: Iterable[Path]) -> dict[str, Any]:
    """A field set in the server's ``FieldsV1`` form."""
    tree: dict[str, Any] = {}
    members = []
    for path in paths:
        node = tree
        for kind, value in path:
            node = node.setdefault(f"{kind}:{value}", {})
        members.append(node)
    for node in members:
        if any(key != "." for key in node):
            node["."] = {}
    return tree


def decode(tree: Mapping[str, Any], path: Path = ()) -> set[Path]:
    out: set[Path] = set()
    if path and (not tree or "." in tree):
        out.add(path)
    for key, child in tree.items():
        if key == ".":
            continue
        kind, _, value = key.partition(":")
        out |= decode(child if isinstance(child, Mapping) else {}, (*path, (kind, value)))
    return out


ManagerKey = tuple[str, str, str]
"""(manager, operation, subresource or "")."""


def read_managers(obj: Mapping[str, Any]) -> dict[ManagerKey, set[Path]]:
    out: dict[ManagerKey, set[Path]] = {}
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, Mapping):
            continue
        key = (
            str(entry.get("manager") or ""),
            str(entry.get("operation") or ""),
            str(entry.get("subresource") or ""),
        )
        out.setdefault(key, set()).update(decode(entry.get("fieldsV1") or {}))
    return out


def write_managers(
    obj: dict[str, Any],
    managers: Mapping[ManagerKey, set[Path]],
    previous: Mapping[str, Any] | None,
    now: str,
) -> None:
    """Store ``managers`` on ``obj``; an entry keeps its old time unless its set changed."""
    old = read_managers(previous) if previous else {}
    times = {
        (str(e.get("manager")), str(e.get("operation")), str(e.get("subresource") or "")): e.get(
            "time"
        )
        for e in ((previous or {}).get("metadata") or {}).get("managedFields") or []
        if isinstance(e, Mapping)
    }
    entries = []
    for key in sorted(managers):
        paths = managers[key]
        if not paths:
            continue
        manager, operation, subresource = key
        entry: dict[str, Any] = {
            "manager": manager,
            "operation": operation,
            "apiVersion": obj.get("apiVersion"),
            "time": times.get(key) if old.get(key) == paths and times.get(key) else now,
            "fieldsType": "FieldsV1",
            "fieldsV1": encode(paths),
        }
        if subresource:
            entry["subresource"] = subresource
        entries.append(entry)
    meta = obj.setdefault("metadata", {})
    if entries:
        meta["managedFields"] = entries
    else:
        meta.pop("managedFields", None)


# -- apply and update ----------------------------------------------------------------------


def _merge_into(
    live: dict[str, Any], config: Mapping[str, Any], path: Path, types: ListTypes
) -> None:
    """Merge ``config`` into ``live`` in place (list-maps item by item, the rest replaced)."""
    for key, value in config.items():
        if value is None:
            continue
        here = (*path, ("f", str(key)))
        current = live.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            _merge_into(current, value, here, types)
            continue
        keys = types.keys(here, value) if isinstance(value, list) and value else None
        if isinstance(current, list) and keys is not None:
            wanted = {item_key(item, keys): item for item in value}
            for item in current:
                key_of = _key_or_none(item, keys)
                if key_of in wanted and isinstance(item, dict):
                    _merge_into(item, wanted.pop(key_of), (*here, ("k", key_of)), types)
            current += [copy.deepcopy(item) for item in wanted.values()]
            continue
        live[key] = copy.deepcopy(value)


@dataclass
class Outcome:
    """The object after a write, and who owns what in it."""

    obj: dict[str, Any]
    managers: dict[ManagerKey, set[Path]]


def _identity(obj: dict[str, Any]) -> dict[str, Any]:
    return obj


def apply(
    live: Mapping[str, Any] | None,
    config: Mapping[str, Any],
    *,
    manager: str,
    force: bool,
    types: ListTypes,
    subresource: str = "",
    has_status: bool = False,
    canonicalize: Callable[[dict[str, Any]], dict[str, Any]] = _identity,
    default: Callable[[dict[str, Any]], dict[str, Any]] = _identity,
) -> Outcome:
    """Server-side apply of ``config`` by ``manager`` onto ``live`` (None: create it).

    ``canonicalize`` is how the server rewrites the values it is sent (canonical
    quantities): it runs before fields are compared, so an equal value in another form
    is no change. ``default`` fills in what the server defaults, on the result only:
    defaults belong to no manager and never overwrite what another manager set.
    Raises :class:`ApplyConflict` (409) and :class:`InvalidApply` (422)."""
    status_only = subresource == "status"
    sent = tracked(canonicalize(dict(config)), status_only=status_only, has_status=has_status)
    applied = fieldset(sent, types)
    me: ManagerKey = (manager, APPLY, subresource)
    managers = read_managers(live) if live else {}
    base: dict[str, Any] = copy.deepcopy(dict(live)) if live else _identity_of(config)
    conflicts: list[tuple[ManagerKey, Path]] = []
    for key, owned in managers.items():
        if key == me:
            continue
        for path in applied & owned:
            if not _is_leaf(sent, path, types):
                continue
            if value_at(base, path, types) != value_at(sent, path, types):
                conflicts.append((key, path))
    if conflicts and not force:
        raise ApplyConflict([(key[0], path) for key, path in sorted(conflicts)])
    for key, path in conflicts:
        managers[key].discard(path)
    merged = base
    _merge_into(merged, sent, (), types)
    previous = managers.get(me, set())
    others: set[Path] = set().union(*(s for k, s in managers.items() if k != me))
    for path in sorted(previous - applied, key=len):  # an item before its fields
        if any(q[: len(path)] == path for q in others):
            continue  # someone else still owns it (or something inside it)
        _delete(merged, path, types)
        _prune(merged, path, types, others | applied)
    managers[me] = applied
    result = default(merged)
    if live:  # on a create there is nothing that could have vanished
        _forget_vanished(result, managers, types)
    return Outcome(result, {k: v for k, v in managers.items() if v})


def _identity_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """What an apply that creates the object keeps of the untracked parts it was sent."""
    meta = config.get("metadata") or {}
    out: dict[str, Any] = {k: config[k] for k in ("apiVersion", "kind") if k in config}
    out["metadata"] = {k: meta[k] for k in ("name", "namespace") if k in meta}
    return out


def _forget_vanished(
    obj: Mapping[str, Any], managers: Mapping[ManagerKey, set[Path]], types: ListTypes
) -> None:
    """Paths that no longer exist leave every set."""
    present = fieldset(tracked(obj, status_only=False, has_status=False), types)
    for owned in managers.values():
        owned &= present


def record_update(
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any],
    *,
    manager: str,
    types: ListTypes,
    subresource: str = "",
    has_status: bool = False,
) -> dict[ManagerKey, set[Path]]:
    """Who owns what after a non-apply write took ``old`` to ``new``: the writer takes
    every field whose value it changed (or added)."""
    status_only = subresource == "status"
    managers = read_managers(old) if old else {}
    new_part = tracked(dict(new), status_only=status_only, has_status=has_status)
    old_part = tracked(dict(old), status_only=status_only, has_status=has_status) if old else {}
    new_paths = fieldset(new_part, types)
    changed = {
        p
        for p in new_paths
        if value_at(old_part, p, types) is _MISSING
        or (
            _is_leaf(new_part, p, types)
            and value_at(old_part, p, types) != value_at(new_part, p, types)
        )
    }
    me: ManagerKey = (manager, UPDATE, subresource)
    for key, owned in managers.items():
        if key != me:
            owned -= changed
    managers.setdefault(me, set()).update(changed)
    if old:
        _forget_vanished(new, managers, types)
    return {k: v for k, v in managers.items() if v}


def owners(obj: Mapping[str, Any], path: Path) -> list[str]:
    """The managers that own ``path`` on ``obj`` (for assertions)."""
    return sorted({key[0] for key, owned in read_managers(obj).items() if path in owned})
