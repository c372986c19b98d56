"""A Kubernetes API emulator for tests and the bench: kmock, plus what a real API
server does on writes and what the operator relies on.

Test support (it needs the ``test`` extra); the operator never imports it.
kmock 0.8 stores objects as sent; :class:`KubeEmulator` adds, on every write:

- server-set metadata: ``uid``, ``creationTimestamp``, ``generation`` (bumped when
  anything but metadata and status changes), ``namespace`` from the URL, and a
  ``resourceVersion`` bumped only on a real change (a write that changes nothing gets
  no new version and sends no watch event, as on a real server);
- what the server does to the values it stores: resource quantities in canonical form
  (:mod:`quantities`: ``nvidia.com/gpu: 1`` reads back as ``"1"``, ``1024Mi`` as
  ``"1Gi"``) and the defaults of Deployments, pod templates and Services
  (:mod:`api_defaults`: a 25 % rolling update, ``progressDeadlineSeconds: 600``, a
  cluster IP ...);
- field ownership (:mod:`field_managers`): ``metadata.managedFields`` on every object;
  server-side apply (``PATCH`` with ``application/apply-patch+yaml``, ``fieldManager``,
  ``force``), creating the object when absent, with 409 on a conflict; every other
  write moves the fields it changes to its manager (``?fieldManager=``, else the
  User-Agent up to its first ``/``);
- 201 for a create, 409 ``AlreadyExists`` for a duplicate name, 409 ``Conflict`` for
  a write carrying a stale ``metadata.resourceVersion``, 422 for a JSON patch whose
  ``test`` fails (kopf's optimistic finalizer patches depend on it), ``PUT``;
- the status subresource: ``/status`` writes change only ``.status``, writes to the
  main resource leave it alone, a create drops it; and the scale subresource:
  ``GET``/``PATCH``/``PUT`` of ``/scale`` as an ``autoscaling/v1`` ``Scale`` for
  Deployments and for custom resources whose CRD declares one;
- custom resources from their CRDs in ``crds/`` and the Gateway API's published
  HTTPRoute CRD (``schemas/``): names, subresources, the list-map keys of their schema;
- label selectors on lists and watches (``?labelSelector=``, :mod:`label_selectors`);
- finalizers and ``deletionTimestamp``; and a garbage collector: deleting an object
  deletes the objects whose ``ownerReferences`` name its ``uid`` (background
  cascading deletion), so owner references are checked by uid, and an object created
  naming an owner already deleted is collected at once (as the real collector does,
  eventually);
- ``faults``: callables that may refuse a write before it happens (``return
  KubernetesError(...)``), to inject API errors;
- with ``admission=True``, the validation a real API server makes of our custom
  resources (:mod:`crd_validation`: the CRD's schema and its CEL rules): a create,
  update, patch or apply of the main resource that the CRD refuses is answered 422
  ``Invalid`` naming each problem, and nothing is stored. Off by default: most tests
  hand the operator specs an older CRD (Helm never upgrades one) would let through.

It still does not do: CRD defaulting of what it stores, admission webhooks, field
selectors, or any controller (a Deployment never gets pods or status unless a test
patches it).

:class:`emulator_thread.EmulatorThread` serves one on 127.0.0.1 in a background thread,
so tests stay synchronous and use the official client. Run
``python tests/support/kube_emulator.py --port 8001`` for a standalone one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime as dt
import json
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import crd_validation
import field_managers as fm
import jsonpatch
import jsonpointer
import kmock
import label_selectors
import yaml
from api_defaults import DEFAULTERS
from kmock import Request
from quantities import QuantityError, canonicalize_quantities

Fault = Callable[[Request], "kmock.KubernetesError | None"]

HISTORY = 1
"""Requests kept in kmock's own history (see ``KubeEmulator._handle``)."""

ALL_VERBS = ("get", "list", "watch", "create", "patch", "update", "delete", "deletecollection")

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
OTHER_CRDS = (SCHEMAS / "gateway.networking.k8s.io_httproutes.json",)
"""CRDs a cluster has besides ours: the Gateway API's HTTPRoute (its published CRD), so
routes are stored, and applied with its schema's list types, as on a cluster that has
the Gateway API installed."""

APPLY_PATCH = "application/apply-patch+yaml"
JSON_PATCH = "application/json-patch+json"


@dataclass(frozen=True)
class Scale:
    """Where a kind's scale subresource reads and writes (dotted paths, as in a CRD)."""

    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    selector: str | None = ".status.selector"


@dataclass(frozen=True)
class KindInfo:
    kind: str
    namespaced: bool = True
    singular: str = ""
    shortnames: frozenset[str] = frozenset()
    subresources: frozenset[str] = frozenset()
    scale: Scale | None = None
    builtin: bool = True
    list_types: fm.ListTypes = field(default_factory=fm.ListTypes)
    crd: Mapping[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)
    """A custom resource's CRD (what admission validates against)."""
    version: str = ""


DEPLOYMENT_SCALE = Scale(selector=None)  # the selector comes from spec.selector

BUILTIN: dict[str, KindInfo] = {
    "v1/namespaces": KindInfo("Namespace", namespaced=False),
    "v1/events": KindInfo("Event"),
    "v1/pods": KindInfo("Pod", subresources=frozenset({"status"})),
    "v1/services": KindInfo("Service", subresources=frozenset({"status"})),
    "v1/configmaps": KindInfo("ConfigMap"),
    "v1/secrets": KindInfo("Secret"),
    "v1/serviceaccounts": KindInfo("ServiceAccount"),
    "apps/v1/deployments": KindInfo(
        "Deployment", subresources=frozenset({"status", "scale"}), scale=DEPLOYMENT_SCALE
    ),
    "rbac.authorization.k8s.io/v1/rolebindings": KindInfo("RoleBinding"),
    "networking.k8s.io/v1/networkpolicies": KindInfo("NetworkPolicy"),
    "policy/v1/poddisruptionbudgets": KindInfo(
        "PodDisruptionBudget", subresources=frozenset({"status"})
    ),
    "events.k8s.io/v1/events": KindInfo("Event"),
    "coordination.k8s.io/v1/leases": KindInfo("Lease"),
}
"""What discovery announces besides the CRDs: the operator's kinds, leases, and
``v1/namespaces`` (kopf hangs without it)."""


def _list_map_keys(
    schema: Mapping[str, Any], path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], tuple[str, ...]]:
    out: dict[tuple[str, ...], tuple[str, ...]] = {}
    if schema.get("type") == "array":
        if schema.get("x-kubernetes-list-type") == "map":
            out[path] = tuple(schema.get("x-kubernetes-list-map-keys") or ())
        out |= _list_map_keys(schema.get("items") or {}, path)
    for name, child in (schema.get("properties") or {}).items():
        out |= _list_map_keys(child, (*path, name))
    return out


def _crd_documents(path: Path) -> list[Any]:
    text = path.read_text()
    return [json.loads(text)] if path.suffix == ".json" else list(yaml.safe_load_all(text))


def crd_kinds(folder: Path = CRD_DIR, others: tuple[Path, ...] = OTHER_CRDS) -> dict[str, KindInfo]:
    """``group/version/plural`` -> what a CRD in ``folder`` (or one of ``others``) declares."""
    out: dict[str, KindInfo] = {}
    for path in [*sorted(folder.glob("*.yaml")), *others]:
        for doc in _crd_documents(path):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec, names = doc["spec"], doc["spec"]["names"]
            for version in spec["versions"]:
                subresources = version.get("subresources") or {}
                scale = subresources.get("scale")
                schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
                out[f"{spec['group']}/{version['name']}/{names['plural']}"] = KindInfo(
                    kind=names["kind"],
                    namespaced=spec.get("scope") == "Namespaced",
                    singular=names.get("singular", names["kind"].lower()),
                    shortnames=frozenset(names.get("shortNames") or ()),
                    subresources=frozenset(subresources),
                    scale=Scale(
                        scale["specReplicasPath"],
                        scale["statusReplicasPath"],
                        scale.get("labelSelectorPath"),
                    )
                    if scale
                    else None,
                    builtin=False,
                    list_types=fm.ListTypes(crd_keys=_list_map_keys(schema), builtin=False),
                    crd=doc,
                    version=version["name"],
                )
    return out


@dataclass(frozen=True)
class Seen:
    """One request the emulator served."""

    method: str
    path: str
    action: str | None
    subresource: str | None
    watch: bool
    agent: str = ""
    """The client's User-Agent (the operator's: ``splitserve-operator/...`` and ``kopf/...``)."""
    query: Mapping[str, str] = field(default_factory=dict)
    content_type: str = ""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def _conflict() -> kmock.KubernetesError:
    return _error(
        409,
        "Conflict",
        "the object has been modified; please apply your changes to the latest version "
        "and try again",
    )


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _essence(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _dig(obj: Mapping[str, Any], dotted: str) -> Any:
    node: Any = obj
    for part in dotted.strip(".").split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _put(obj: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.strip(".").split(".")
    node = obj
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _selector_string(selector: Any) -> str:
    labels = (selector or {}).get("matchLabels") or {} if isinstance(selector, Mapping) else {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def manager_of(request: Request) -> str:
    """The field manager of a write: ``?fieldManager=``, else the User-Agent's prefix."""
    named = request.params.get("fieldManager")
    if named:
        return str(named)
    agent = str(request.headers.get("User-Agent", ""))
    return agent.split("/", 1)[0][:128] or "unknown"


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    faults: list[Fault] = attrs.field(factory=list)
    log: list[Seen] = attrs.field(factory=list)
    """Every request served, oldest first (kmock's own history is trimmed)."""
    crd_dir: Path = CRD_DIR
    admission: bool = False
    """Validate writes of the custom resources in ``crd_dir`` against their CRD."""
    _kinds: dict[Any, KindInfo] = attrs.field(factory=dict, init=False)
    _version: int = attrs.field(default=0, init=False)
    _deleted_at: dict[tuple[Any, Any, Any], int] = attrs.field(factory=dict, init=False)
    _gone_uids: set[str] = attrs.field(factory=set, init=False)
    """uids of deleted objects: a dependent created naming one is collected at once."""
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _builtin_payloads: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name, info in {**BUILTIN, **crd_kinds(self.crd_dir)}.items():
            self.resources[name] = kmock.ResourceInfo(
                kind=info.kind,
                singular=info.singular or info.kind.lower(),
                namespaced=info.namespaced,
                verbs=set(ALL_VERBS),
                shortnames=set(info.shortnames),
                subresources=set(info.subresources),
            )
            self._kinds[kmock.resource(name)] = info
        self._builtin_payloads = len(self._payloads)

    @property
    def _plain(self) -> bool:
        """No test-defined reaction: answer from the stored state directly (kmock's
        dispatch evaluates every reaction's filters on every request)."""
        return len(self._payloads) == self._builtin_payloads

    def _info(self, resource: Any) -> KindInfo:
        return self._kinds.get(resource) or KindInfo(kind="")

    def _has_status(self, resource: Any) -> bool:
        return "status" in self._info(resource).subresources

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    # -- reads -------------------------------------------------------------------------

    def _matching(self, request: Request) -> Callable[[Mapping[str, Any]], bool]:
        try:
            wanted = label_selectors.parse(request.params.get("labelSelector"))
        except label_selectors.SelectorError as exc:
            raise _error(400, "BadRequest", str(exc)) from exc

        def matches(obj: Mapping[str, Any]) -> bool:
            labels = (obj.get("metadata") or {}).get("labels") or {}
            return wanted(labels if isinstance(labels, Mapping) else {})

        return matches

    async def _serve_list(self, request: Request) -> dict[str, Any]:
        if request.resource not in self._kinds:
            raise kmock.KubernetesResourceNotFoundError()
        matches = self._matching(request)
        async with self._lock:
            items = [
                copy.deepcopy(obj.raw)
                for (res, ns, name), obj in self._objects.items()
                if res == request.resource
                and not obj.deleted
                and self._in_scope(request, ns, name)
                and matches(obj.raw)
            ]
        return {"metadata": {"resourceVersion": str(self._version)}, "items": items}

    async def _serve_watch(self, request: Request) -> AsyncIterator[Any]:
        """Watch as an API server does: from ``?resourceVersion=N`` only what changed
        after N (kmock replays everything, which hands kopf stale bodies after its own
        patches); without it, every object as ADDED. Never an older version of an object
        after a newer one. Only objects that match ``?labelSelector=``."""
        yield b""  # send the headers now
        assert request.resource is not None
        matches = self._matching(request)
        bus = self._buses[request.resource]
        marker = await bus.mark()
        try:
            raw_since = request.params.get("resourceVersion") or ""
            since = int(raw_since) if raw_since.isdigit() and raw_since != "0" else None
            replay: list[tuple[int, str, dict[str, Any]]] = []
            async with self._lock:
                for key, obj in list(self._objects.items()):
                    res, ns, name = key
                    if res != request.resource or not self._in_scope(request, ns, name):
                        continue
                    if obj.deleted:
                        gone = self._deleted_at.get(key)
                        last = obj.last.raw
                        if (
                            since is not None
                            and gone is not None
                            and gone > since
                            and matches(last)
                        ):
                            replay.append((gone, "DELETED", copy.deepcopy(last)))
                        continue
                    raw = copy.deepcopy(obj.raw)
                    version = int(raw.get("metadata", {}).get("resourceVersion") or 0)
                    if (since is None or version > since) and matches(raw):
                        replay.append((version, "ADDED" if since is None else "MODIFIED", raw))
            sent: dict[tuple[Any, Any], int] = {}
            for version, kind, raw in sorted(replay, key=lambda item: item[0]):
                meta = raw.get("metadata", {})
                sent[(meta.get("namespace"), meta.get("name"))] = version
                yield {"type": kind, "object": raw}
            async for event in bus.stream(since=marker):
                obj = event.get("object", {})
                meta = obj.get("metadata", {})
                ns, name = meta.get("namespace"), meta.get("name")
                if not self._in_scope(request, ns, name) or not matches(obj):
                    continue
                version = int(meta.get("resourceVersion") or 0)
                if sent.get((ns, name), -1) >= version:
                    continue
                sent[(ns, name)] = version
                yield event
        finally:
            await bus.unmark(marker)

    @staticmethod
    def _in_scope(request: Request, namespace: Any, name: Any) -> bool:
        return (request.namespace is None or namespace == request.namespace) and (
            request.name is None or name == request.name
        )

    def _live(self, request: Request) -> tuple[Any, dict[str, Any] | None]:
        key: Any = (request.resource, request.namespace, request.name)
        try:
            obj = self._objects[key]
        except KeyError:
            return key, None
        return key, (None if obj.deleted else obj.raw)

    def _fetch(self, request: Request) -> aiohttp.web.StreamResponse:
        _key, live = self._live(request)
        if live is None:
            raise kmock.KubernetesObjectNotFoundError()
        if request.subresource == "scale":
            return aiohttp.web.json_response(self._scale_view(request.resource, live))
        return aiohttp.web.json_response(live)

    def _scale_view(self, resource: Any, obj: Mapping[str, Any]) -> dict[str, Any]:
        scale = self._info(resource).scale
        if scale is None:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        meta = obj.get("metadata") or {}
        if scale.selector is None:
            selector = _selector_string(_dig(obj, ".spec.selector"))
        else:
            selector = _dig(obj, scale.selector)
        status: dict[str, Any] = {"replicas": _dig(obj, scale.status_replicas) or 0}
        if selector:
            status["selector"] = selector
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": _dig(obj, scale.spec_replicas) or 0},
            "status": status,
        }

    # -- dispatch ----------------------------------------------------------------------

    async def _handle(self, request: Request) -> aiohttp.web.StreamResponse:
        # kmock's filters scan its whole request history on every request: keep it short
        # (thousands of requests would make each one take tens of milliseconds) and keep
        # our own light log instead.
        method = str(request.method.value).upper() if request.method else ""
        self.log.append(
            Seen(
                method=method,
                path=request.url.path,
                action=str(request.action.value) if request.action else None,
                subresource=request.subresource,
                watch=request.params.get("watch") == "true",
                agent=str(request.headers.get("User-Agent", "")),
                query=dict(request.params),
                content_type=str(request.headers.get("Content-Type", "")).split(";")[0],
            )
        )
        del self._requests[:-HISTORY]
        write = method in ("POST", "PATCH", "PUT", "DELETE") and request.resource is not None
        if not write:
            if request.action == kmock.action.FETCH and (
                self._plain or request.subresource == "scale"
            ):
                return self._fetch(request)
            return await super()._handle(request)
        async with self._write_lock:
            for fault in list(self.faults):
                refusal = fault(request)
                if refusal is not None:
                    raise refusal
            events: list[tuple[Any, dict[str, Any]]] = []
            created = False
            async with self._lock:
                if method == "POST" and request.name is None:
                    answer, created = self._create(request, events), True
                elif method == "DELETE":
                    answer = self._delete(request, events)
                elif request.subresource == "scale":
                    answer = self._scale_write(request, events)
                elif method == "PATCH" and self._content_type(request) == APPLY_PATCH:
                    answer, created = self._apply(request, events)
                elif method in ("PATCH", "PUT"):
                    answer = self._update(request, events, replace=method == "PUT")
                else:
                    raise _error(405, "MethodNotAllowed", f"{method} is not served here")
            for resource, event in events:
                await self._buses[resource].put(event)
            if self._plain or request.subresource == "scale":
                return aiohttp.web.json_response(answer, status=201 if created else 200)
            # Render the answer from the stored state (kmock's fallbacks and any reactions).
            response = await kmock.RawHandler._handle(self, request)
            if created and response.status == 200:
                response.set_status(201)
            return response

    @staticmethod
    def _content_type(request: Request) -> str:
        return str(request.headers.get("Content-Type", "")).split(";")[0].strip()

    # -- writes (called with self._lock held) ------------------------------------------

    def _normalize(self, resource: Any, obj: dict[str, Any]) -> dict[str, Any]:
        """What the server does to the values of an object it stores."""
        if not self._info(resource).builtin:
            return obj
        try:
            return canonicalize_quantities(obj)  # type: ignore[no-any-return]
        except QuantityError as exc:
            raise _error(422, "Invalid", f"quantities must match the expected form: {exc}") from exc

    def _admit(self, resource: Any, obj: Mapping[str, Any]) -> None:
        """Refuse, as the API server does, a custom resource its CRD does not accept (the
        status aside: it has its own subresource)."""
        info = self._info(resource)
        if not self.admission or info.crd is None:
            return
        body = {k: v for k, v in obj.items() if k != "status"}
        found = crd_validation.problems(body, info.crd, info.version)
        if found:
            name = (obj.get("metadata") or {}).get("name")
            group = info.crd["spec"]["group"]
            raise _error(
                422, "Invalid", f'{info.kind}.{group} "{name}" is invalid: {"; ".join(found)}'
            )

    def _default(self, resource: Any, obj: dict[str, Any]) -> dict[str, Any]:
        defaulter = DEFAULTERS.get(self._resource_name(resource))
        if defaulter is not None:
            defaulter(obj)
        return obj

    @staticmethod
    def _resource_name(resource: Any) -> str:
        group = getattr(resource, "group", "") or ""
        return "/".join(p for p in (group, resource.version, resource.plural) if p)

    def _create(self, request: Request, events: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
        data = request.data
        if not isinstance(data, dict):
            raise _error(400, "BadRequest", "the body must be a JSON object")
        meta = data.get("metadata")
        if not isinstance(meta, dict):
            meta = data["metadata"] = {}
        if request.namespace:
            meta["namespace"] = request.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{secrets.token_hex(3)[:5]}"
        name = meta.get("name")
        if not name:
            raise _error(422, "Invalid", "metadata.name: Required value")
        key: Any = (request.resource, meta.get("namespace"), name)
        if key in self._objects and not self._objects[key].deleted:
            plural = request.resource.plural if request.resource else "objects"
            raise _error(409, "AlreadyExists", f'{plural} "{name}" already exists')
        meta.pop("managedFields", None)
        if self._has_status(request.resource):
            data.pop("status", None)
        data = self._default(request.resource, self._normalize(request.resource, data))
        self._admit(request.resource, data)
        managers = fm.record_update(
            None,
            data,
            manager=manager_of(request),
            types=self._info(request.resource).list_types,
            has_status=self._has_status(request.resource),
        )
        return self._insert(key, data, managers, events)

    def _insert(
        self,
        key: Any,
        data: dict[str, Any],
        managers: Mapping[fm.ManagerKey, set[fm.Path]],
        events: list[tuple[Any, dict[str, Any]]],
    ) -> dict[str, Any]:
        meta = data.setdefault("metadata", {})
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_version(),
            creationTimestamp=_now(),
            generation=1,
        )
        meta.pop("deletionTimestamp", None)
        fm.write_managers(data, managers, None, _now())
        if key in self._objects:
            self._objects[key].create(data)
        else:
            self._objects[key] = data
        # stored objects are replaced on a write, never changed in place: share them
        answer = data
        events.append((key[0], {"type": "ADDED", "object": answer}))
        owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []
                  if isinstance(ref, Mapping)}  # fmt: skip
        if owners & self._gone_uids:  # its owner is gone: the collector takes it too
            self._delete_key(key, events)
        return answer

    def _apply(
        self, request: Request, events: list[tuple[Any, dict[str, Any]]]
    ) -> tuple[dict[str, Any], bool]:
        """Server-side apply; creates the object when it does not exist."""
        config = request.data
        if not isinstance(config, dict):
            raise _error(400, "BadRequest", "an apply patch must be an object")
        manager = request.params.get("fieldManager")
        if not manager:
            raise _error(422, "Invalid", "fieldManager: Required value: is required for apply")
        info = self._info(request.resource)
        if config.get("kind") != info.kind or not config.get("apiVersion"):
            raise _error(400, "BadRequest", f"apply needs apiVersion and kind {info.kind!r}")
        meta = config.get("metadata") or {}
        if meta.get("name") != request.name:
            raise _error(400, "BadRequest", "metadata.name must match the name in the URL")
        subresource = request.subresource or ""
        if subresource not in ("", "status"):
            raise _error(404, "NotFound", f"apply to {subresource} is not served")
        key, live = self._live(request)
        if live is None and subresource:
            raise kmock.KubernetesObjectNotFoundError()
        if live is not None and meta.get("resourceVersion") not in (
            None,
            live["metadata"].get("resourceVersion"),
        ):
            raise _conflict()
        has_status = self._has_status(request.resource)
        config.setdefault("metadata", {})["namespace"] = request.namespace
        if live is None and has_status:
            config.pop("status", None)
        try:
            outcome = fm.apply(
                live,
                config,
                manager=str(manager),
                force=request.params.get("force") == "true",
                types=info.list_types,
                subresource=subresource,
                has_status=has_status,
                canonicalize=lambda obj: self._normalize(request.resource, obj),
                default=lambda obj: self._default(request.resource, obj),
            )
        except fm.ApplyConflict as exc:
            raise _error(409, "Conflict", str(exc)) from exc
        except fm.InvalidApply as exc:
            raise _error(422, "Invalid", str(exc)) from exc
        if not subresource:
            self._admit(request.resource, outcome.obj)
        if live is None:
            return self._insert(key, outcome.obj, outcome.managers, events), True
        return self._commit(key, live, outcome.obj, outcome.managers, events), False

    def _update(
        self, request: Request, events: list[tuple[Any, dict[str, Any]]], *, replace: bool
    ) -> dict[str, Any]:
        key, live = self._live(request)
        if live is None:
            raise kmock.KubernetesObjectNotFoundError()
        if request.subresource not in (None, "status"):
            raise _error(404, "NotFound", f"subresource {request.subresource} is not emulated")
        current: dict[str, Any] = copy.deepcopy(live)
        data = request.data
        if isinstance(data, list) and not replace:
            try:
                new = jsonpatch.apply_patch(current, data)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise _error(422, "Invalid", f"the JSON patch was not applied: {exc}") from exc
        elif isinstance(data, dict):
            wanted_version = (data.get("metadata") or {}).get("resourceVersion")
            if wanted_version is not None and wanted_version != current["metadata"].get(
                "resourceVersion"
            ):
                raise _conflict()
            new = copy.deepcopy(data) if replace else merge_patch(current, data)
        else:
            raise _error(400, "BadRequest", "a patch must be a JSON object or a JSON patch list")
        has_status = self._has_status(request.resource)
        if request.subresource == "status":
            new = {**current, "status": new.get("status")}
            if new["status"] is None:
                del new["status"]
        elif has_status:
            new.pop("status", None)
            if "status" in current:
                new["status"] = current["status"]
        meta = new.setdefault("metadata", {})
        for name in ("uid", "creationTimestamp", "name", "namespace", "generation"):
            if name in current["metadata"]:
                meta[name] = current["metadata"][name]
        if (request.subresource == "status" or "managedFields" not in meta) and (
            "managedFields" in current["metadata"]
        ):
            meta["managedFields"] = current["metadata"]["managedFields"]
        new = self._default(request.resource, self._normalize(request.resource, new))
        if request.subresource is None:
            self._admit(request.resource, new)
        info = self._info(request.resource)
        if meta.get("managedFields") != current["metadata"].get("managedFields"):
            # a client that writes managedFields itself resets them to what it wrote
            managers = fm.read_managers(new)
        else:
            managers = fm.record_update(
                current,
                new,
                manager=manager_of(request),
                types=info.list_types,
                subresource=request.subresource or "",
                has_status=has_status,
            )
        return self._commit(key, current, new, managers, events)

    def _scale_write(
        self, request: Request, events: list[tuple[Any, dict[str, Any]]]
    ) -> dict[str, Any]:
        key, live = self._live(request)
        if live is None:
            raise kmock.KubernetesObjectNotFoundError()
        scale = self._info(request.resource).scale
        view = self._scale_view(request.resource, live)
        body = request.data
        if not isinstance(body, dict):
            raise _error(400, "BadRequest", "a Scale must be a JSON object")
        wanted = (
            copy.deepcopy(body)
            if request.method.value.upper() == "PUT"
            else merge_patch(view, body)
        )
        version = (wanted.get("metadata") or {}).get("resourceVersion")
        if version is not None and version != live["metadata"].get("resourceVersion"):
            raise _conflict()
        replicas = (wanted.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise _error(422, "Invalid", "spec.replicas: must be a non-negative integer")
        assert scale is not None
        new = copy.deepcopy(live)
        _put(new, scale.spec_replicas, replicas)
        managers = fm.record_update(
            live,
            new,
            manager=manager_of(request),
            types=self._info(request.resource).list_types,
            subresource="scale",
            has_status=self._has_status(request.resource),
        )
        stored = self._commit(key, live, new, managers, events)
        return self._scale_view(request.resource, stored)

    def _commit(
        self,
        key: Any,
        current: Mapping[str, Any],
        new: dict[str, Any],
        managers: Mapping[fm.ManagerKey, set[fm.Path]],
        events: list[tuple[Any, dict[str, Any]]],
    ) -> dict[str, Any]:
        """Store ``new`` over ``current``: a new version and a watch event only when
        something changed; the end of a deletion once the finalizers are gone."""
        meta = new.setdefault("metadata", {})
        meta["resourceVersion"] = current["metadata"].get("resourceVersion")
        meta["generation"] = current["metadata"].get("generation")
        fm.write_managers(new, managers, current, _now())
        if new == current:
            return dict(current)  # no-op: no new version, no watch event
        if _essence(new) != _essence(current):
            meta["generation"] = int(meta.get("generation") or 0) + 1
        meta["resourceVersion"] = self._next_version()
        obj = self._objects[key]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            obj.create(new)
            obj.delete()
            self._deleted_at[key] = int(meta["resourceVersion"])
            events.append((key[0], {"type": "DELETED", "object": new}))
            self._collect_garbage(meta.get("uid"), events)
            return new
        obj.create(new)
        events.append((key[0], {"type": "MODIFIED", "object": new}))
        return new

    def _delete(self, request: Request, events: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
        key: Any = (request.resource, request.namespace, request.name)
        if request.name is None or key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        self._delete_key(key, events)
        return copy.deepcopy(self._objects[key].last.raw)

    def _delete_key(
        self, key: tuple[Any, Any, Any], events: list[tuple[Any, dict[str, Any]]]
    ) -> None:
        obj = self._objects[key]
        current = copy.deepcopy(obj.raw)
        meta = current.setdefault("metadata", {})
        if meta.get("deletionTimestamp"):
            return
        if meta.get("finalizers"):
            meta["deletionTimestamp"] = _now()
            meta["resourceVersion"] = self._next_version()
            obj.create(current)
            events.append((key[0], {"type": "MODIFIED", "object": current}))
            return
        meta["resourceVersion"] = self._next_version()
        self._deleted_at[key] = int(meta["resourceVersion"])
        obj.delete()
        events.append((key[0], {"type": "DELETED", "object": current}))
        self._collect_garbage(meta.get("uid"), events)

    def _collect_garbage(self, uid: object, events: list[tuple[Any, dict[str, Any]]]) -> None:
        if not uid:
            return
        self._gone_uids.add(str(uid))
        dependents = [
            key
            for key, obj in list(self._objects.items())
            if not obj.deleted
            and any(
                isinstance(ref, Mapping) and ref.get("uid") == uid
                for ref in (obj.raw.get("metadata") or {}).get("ownerReferences") or []
            )
        ]
        for key in dependents:
            if not self._objects[key].deleted:
                self._delete_key(key, events)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a Kubernetes API emulator (kmock).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)

    async def serve() -> None:
        async with (
            KubeEmulator() as emulator,
            kmock.Server(emulator, host=args.host, port=args.port) as server,
        ):
            print(f"serving on {str(server.url).rstrip('/')}", flush=True)
            await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
