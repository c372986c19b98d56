"""A Kubernetes API emulator for tests and the bench: kmock, plus what a real API
server does on writes and kopf relies on.

Test support (it needs the ``test`` extra); the operator never imports it.
kmock 0.8 stores objects as sent; :class:`KubeEmulator` adds, on every write:

- server-set metadata: ``uid``, ``creationTimestamp``, ``generation`` (bumped when
  anything but metadata and status changes), ``namespace`` from the URL, and a
  ``resourceVersion`` bumped on every change (a no-op patch changes nothing and
  sends no watch event, as on a real server);
- 201 for a create, 409 ``AlreadyExists`` for a duplicate name, 409 ``Conflict`` for
  a merge patch carrying a stale ``metadata.resourceVersion``, 422 for a JSON patch
  whose ``test`` fails (kopf's optimistic finalizer patches depend on it);
- the status subresource: ``/status`` patches change only ``.status``, patches to
  the main resource leave ``.status`` alone, a create drops it;
- finalizers and ``deletionTimestamp``; and a garbage collector: deleting an object
  deletes the objects whose ``ownerReferences`` name its ``uid`` (background
  cascading deletion), so owner references are checked by uid, and an object created
  naming an owner already deleted is collected at once (as the real collector does,
  eventually);
- ``faults``: callables that may refuse a write before it happens (``return
  KubernetesError(...)``), to inject API errors.

It still does not do: schema validation, defaulting, label selectors, PUT, or any
controller (a Deployment never gets pods or status unless a test patches it).

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
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock import Request

Fault = Callable[[Request], "kmock.KubernetesError | None"]

HISTORY = 1
"""Requests kept in kmock's own history (see ``KubeEmulator._handle``)."""

ALL_VERBS = ("get", "list", "watch", "create", "patch", "update", "delete", "deletecollection")

RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "v1/events": {"kind": "Event"},
    "v1/pods": {"kind": "Pod", "subresources": {"status"}},
    "v1/services": {"kind": "Service", "subresources": {"status"}},
    "v1/configmaps": {"kind": "ConfigMap"},
    "v1/secrets": {"kind": "Secret"},
    "v1/serviceaccounts": {"kind": "ServiceAccount"},
    "apps/v1/deployments": {"kind": "Deployment", "subresources": {"status", "scale"}},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding"},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy"},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "subresources": {"status"}},
    "events.k8s.io/v1/events": {"kind": "Event"},
    "gateway.networking.k8s.io/v1/httproutes": {"kind": "HTTPRoute"},
    "splitserve.io/v1alpha1/inferenceservices": {
        "kind": "InferenceService",
        "singular": "inferenceservice",
        "shortnames": {"sisvc"},
        "subresources": {"status"},
    },
}
"""What discovery announces: the operator's kinds, and ``v1/namespaces`` (kopf hangs
without it)."""


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


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


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


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    faults: list[Fault] = attrs.field(factory=list)
    log: list[Seen] = attrs.field(factory=list)
    """Every request served, oldest first (kmock's own history is trimmed)."""
    _version: int = attrs.field(default=0, init=False)
    _deleted_at: dict[tuple[Any, Any, Any], int] = attrs.field(factory=dict, init=False)
    _gone_uids: set[str] = attrs.field(factory=set, init=False)
    """uids of deleted objects: a dependent created naming one is collected at once."""
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _builtin_payloads: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name, info in RESOURCES.items():
            self.resources[name] = kmock.ResourceInfo(
                kind=info["kind"],
                singular=info.get("singular", info["kind"].lower()),
                namespaced=info.get("namespaced", True),
                verbs=set(ALL_VERBS),
                shortnames=info.get("shortnames", set()),
                subresources=info.get("subresources", set()),
            )
        self._builtin_payloads = len(self._payloads)

    @property
    def _plain(self) -> bool:
        """No test-defined reaction: answer from the stored state directly (kmock's
        dispatch evaluates every reaction's filters on every request)."""
        return len(self._payloads) == self._builtin_payloads

    def _has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    async def _serve_list(self, request: Request) -> dict[str, Any]:
        payload = await super()._serve_list(request)
        assert isinstance(payload, dict)
        payload["metadata"] = {"resourceVersion": str(self._version)}
        return payload

    async def _serve_watch(self, request: Request) -> AsyncIterator[Any]:
        """Watch as an API server does: from ``?resourceVersion=N`` only what changed
        after N (kmock replays everything, which hands kopf stale bodies after its own
        patches); without it, every object as ADDED. Never an older version of an object
        after a newer one."""
        yield b""  # send the headers now
        assert request.resource is not None
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
                        if since is not None and gone is not None and gone > since:
                            replay.append((gone, "DELETED", copy.deepcopy(obj.last.raw)))
                        continue
                    raw = copy.deepcopy(obj.raw)
                    version = int(raw.get("metadata", {}).get("resourceVersion") or 0)
                    if since is None or version > since:
                        replay.append((version, "ADDED" if since is None else "MODIFIED", raw))
            sent: dict[tuple[Any, Any], int] = {}
            for version, kind, raw in sorted(replay, key=lambda item: item[0]):
                meta = raw.get("metadata", {})
                sent[(meta.get("namespace"), meta.get("name"))] = version
                yield {"type": kind, "object": raw}
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                ns, name = meta.get("namespace"), meta.get("name")
                if not self._in_scope(request, ns, name):
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

    async def _handle(self, request: Request) -> aiohttp.web.StreamResponse:
        # kmock's filters scan its whole request history on every request: keep it short
        # (thousands of requests would make each one take tens of milliseconds) and keep
        # our own light log instead.
        self.log.append(
            Seen(
                method=str(request.method.value).upper() if request.method else "",
                path=request.url.path,
                action=str(request.action.value) if request.action else None,
                subresource=request.subresource,
                watch=request.params.get("watch") == "true",
                agent=str(request.headers.get("User-Agent", "")),
            )
        )
        del self._requests[:-HISTORY]
        writes = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
        if request.resource is None or request.action not in writes:
            if request.action == kmock.action.FETCH and self._plain:
                return self._fetch(request)
            return await super()._handle(request)
        async with self._write_lock:
            for fault in list(self.faults):
                refusal = fault(request)
                if refusal is not None:
                    raise refusal
            events: list[tuple[Any, dict[str, Any]]] = []
            async with self._lock:
                if request.action == kmock.action.CREATE:
                    answer = self._create(request, events)
                elif request.action == kmock.action.UPDATE:
                    answer = self._update(request, events)
                else:
                    answer = self._delete(request, events)
            for resource, event in events:
                await self._buses[resource].put(event)
            if self._plain:
                status = 201 if request.action == kmock.action.CREATE else 200
                return aiohttp.web.json_response(answer, status=status)
            # Render the answer from the stored state (kmock's fallbacks and any reactions).
            response = await kmock.RawHandler._handle(self, request)
            if request.action == kmock.action.CREATE and response.status == 200:
                response.set_status(201)
            return response

    # -- writes (called with self._lock held) ------------------------------------------

    def _fetch(self, request: Request) -> aiohttp.web.StreamResponse:
        key: Any = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return aiohttp.web.json_response(self._objects[key].raw)

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
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_version(),
            creationTimestamp=_now(),
            generation=1,
        )
        meta.pop("deletionTimestamp", None)
        if self._has_status(request.resource):
            data.pop("status", None)
        if key in self._objects:
            self._objects[key].create(data)
        else:
            self._objects[key] = data
        answer = copy.deepcopy(data)
        events.append((request.resource, {"type": "ADDED", "object": answer}))
        owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []
                  if isinstance(ref, Mapping)}  # fmt: skip
        if owners & self._gone_uids:  # its owner is gone: the collector takes it too
            self._delete_key(key, events)
        return answer

    def _update(self, request: Request, events: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
        key: Any = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        if request.subresource not in (None, "status"):
            raise _error(404, "NotFound", f"subresource {request.subresource} is not emulated")
        obj = self._objects[key]
        current: dict[str, Any] = copy.deepcopy(obj.raw)
        data = request.data
        if isinstance(data, list):
            try:
                new = jsonpatch.apply_patch(current, data)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise _error(422, "Invalid", f"the JSON patch was not applied: {exc}") from exc
        elif isinstance(data, dict):
            wanted_version = (data.get("metadata") or {}).get("resourceVersion")
            if wanted_version is not None and wanted_version != current["metadata"].get(
                "resourceVersion"
            ):
                raise _error(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your "
                    "changes to the latest version and try again",
                )
            new = merge_patch(current, data)
        else:
            raise _error(400, "BadRequest", "a patch must be a JSON object or a JSON patch list")
        if request.subresource == "status":
            new = {**current, "status": new.get("status")}
            if new["status"] is None:
                del new["status"]
        elif self._has_status(request.resource):
            new.pop("status", None)
            if "status" in current:
                new["status"] = current["status"]
        meta = new.setdefault("metadata", {})
        for field in (
            "uid",
            "creationTimestamp",
            "name",
            "namespace",
            "generation",
            "resourceVersion",
        ):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        if new == current:
            return current  # no-op: no new version, no watch event
        if _essence(new) != _essence(current):
            meta["generation"] = int(meta.get("generation") or 0) + 1
        meta["resourceVersion"] = self._next_version()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            obj.create(new)
            obj.delete()
            self._deleted_at[key] = int(meta["resourceVersion"])
            events.append((request.resource, {"type": "DELETED", "object": new}))
            self._collect_garbage(meta.get("uid"), events)
            return new
        obj.create(new)
        answer = copy.deepcopy(new)
        events.append((request.resource, {"type": "MODIFIED", "object": answer}))
        return answer

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
