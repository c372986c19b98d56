"""The Kubernetes adapter: every API call the operator makes goes through here.

Built on the official ``kubernetes`` client's transport (its configuration,
TLS, auth and connection pool), with plain dicts in and out: the operator
works on manifests, and skipping the client's model classes keeps it fast. A request
goes straight to the client's urllib3 connection pool for the API server, with the
client's own auth headers and the body encoded once (the client's generic request path
walks every body to sanitise it and routes each URL through the pool manager again).

Objects are written with server-side apply (:meth:`KubeClient.apply`: ``PATCH`` with
``application/apply-patch+yaml``, a ``fieldManager`` and ``force``), each writer under a
field manager of its own: :data:`FIELD_MANAGER` for the reconciler, :data:`PLANNER` for
the autoscaling loop.

Reconcile and the autoscaling loop both reach the API through :class:`Cluster`, the
part of :class:`KubeClient` they use (unit tests hand them fakes).
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import json
import logging
import secrets
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import kubernetes.client
import kubernetes.config
import urllib3

from splitserve_operator.api.fields import timestamp
from splitserve_operator.render.names import (
    API_VERSION,
    KIND,
    MANAGED_BY,
    PLURAL,
    POOL_KIND,
    POOL_PLURAL,
)

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
"""Server-side apply (a JSON body is valid YAML)."""

FIELD_MANAGER = MANAGED_BY
"""The reconciler's field manager: every child object, the status it reports."""
PLANNER = "splitserve-planner"
"""The autoscaling loop's field manager: a pool's replicas while autoscaling is on, the
planner's status and condition."""


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the API."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


KINDS: dict[tuple[str, str], Kind] = {
    (k.api_version, k.kind): k
    for k in (
        Kind(API_VERSION, KIND, PLURAL),
        Kind(API_VERSION, POOL_KIND, POOL_PLURAL),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("v1", "Service", "services"),
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Secret", "secrets"),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("v1", "Event", "events"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes"),
        Kind("coordination.k8s.io/v1", "Lease", "leases"),
        Kind("v1", "Pod", "pods"),
    )
}
INFERENCE_SERVICE = KINDS[(API_VERSION, KIND)]
WORKER_POOL = KINDS[(API_VERSION, POOL_KIND)]
DEPLOYMENT = KINDS[("apps/v1", "Deployment")]
LEASE = KINDS[("coordination.k8s.io/v1", "Lease")]
POD = KINDS[("v1", "Pod")]
"""Only read, and relabelled: the planner switches a ``spec.flex`` pod by its role label."""


def kind_of(manifest: Mapping[str, Any]) -> Kind:
    key = (str(manifest.get("apiVersion")), str(manifest.get("kind")))
    try:
        return KINDS[key]
    except KeyError:
        raise ValueError(f"the operator does not manage {key[1]} ({key[0]})") from None


class ApiError(Exception):
    """The API server refused a call (``status`` is its HTTP code; 0: no answer)."""

    def __init__(
        self, status: int, reason: str, message: str, retry_after: float | None = None
    ) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        """Seconds the server asked the client to wait (``Retry-After``, on 429 or 503)."""
        super().__init__(f"{status} {reason}: {message}")

    @property
    def transient(self) -> bool:
        """Worth retrying as is: no answer, throttled, a server error, a conflict."""
        return self.status == 0 or self.status in (409, 429) or self.status >= 500


class NotFound(ApiError):
    pass


class AlreadyExists(ApiError):
    pass


class Conflict(ApiError):
    """409 on a write: a stale ``resourceVersion``, or an apply that would change fields
    another field manager owns."""


class Forbidden(ApiError):
    pass


class Invalid(ApiError):
    """422: the server rejected the object (bad field values)."""


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    value = (headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _error(
    status: int, body: bytes | str | None, headers: Mapping[str, str] | None = None
) -> ApiError:
    text = body.decode(errors="replace") if isinstance(body, bytes) else (body or "")
    reason, message = "", text[:500]
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            reason = str(doc.get("reason") or "")
            message = str(doc.get("message") or message)[:1000]
    except json.JSONDecodeError:
        pass
    cls: type[ApiError] = ApiError
    if status == 404:
        cls = NotFound
    elif status == 409:
        cls = AlreadyExists if reason in ("AlreadyExists", "Object Already Exists") else Conflict
    elif status == 403:
        cls = Forbidden
    elif status == 422:
        cls = Invalid
    return cls(status, reason, message, _retry_after(headers))


@dataclass(frozen=True)
class Applied:
    """What a server-side apply answered."""

    obj: dict[str, Any]
    created: bool
    """201: the apply made the object."""


class Cluster(Protocol):
    """What the reconciler and the autoscaling loop need from the API (:class:`KubeClient`;
    fakes in unit tests)."""

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None: ...
    def list(
        self, kind: Kind, namespace: str | None = None, label_selector: str | None = None
    ) -> list[dict[str, Any]]: ...
    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]: ...
    def patch(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        patch: Any,
        *,
        subresource: str | None = None,
        content_type: str = MERGE_PATCH,
    ) -> dict[str, Any]: ...
    def apply(
        self,
        manifest: Mapping[str, Any],
        *,
        field_manager: str,
        force: bool = True,
        subresource: str | None = None,
    ) -> Applied: ...
    def event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str) -> None: ...


class KubeClient:
    """A thread-safe, dict-based client over one ``kubernetes.client.ApiClient``."""

    def __init__(
        self,
        configuration: kubernetes.client.Configuration,
        *,
        timeout: float = 30.0,
        component: str = MANAGED_BY,
        user_agent: str = f"{MANAGED_BY}/0.1.0",
    ) -> None:
        self.configuration = configuration
        self.api = kubernetes.client.ApiClient(configuration)
        self.api.user_agent = user_agent
        self.timeout = timeout
        self._timeout = urllib3.Timeout(total=timeout)
        # One pool for the API server, addressed by path (below any path prefix of the
        # host URL); through a proxy, the pool manager builds each request.
        self._pool: urllib3.HTTPConnectionPool | None = (
            None
            if configuration.proxy
            else self.api.rest_client.pool_manager.connection_from_url(configuration.host)
        )
        self._prefix = (urllib3.util.parse_url(configuration.host).path or "").rstrip("/")
        self.component = component
        self.calls: collections.Counter[str] = collections.Counter()
        """Requests sent, by HTTP method (what a reconcile costs the API server)."""
        self._calls_lock = threading.Lock()

    def close(self) -> None:
        self.api.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> dict[str, Any]:
        return self._call(method, path, body=body, content_type=content_type, query=query)[0]

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> tuple[dict[str, Any], int]:
        """The answer's body and HTTP status."""
        with self._calls_lock:
            self.calls[method] += 1
        headers = {"Accept": "application/json", "Content-Type": content_type}
        headers.update(self.api.default_headers)
        self.api.update_params_for_auth(headers, None, ["BearerToken"], path, method, None)
        target = path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        try:
            if self._pool is not None:
                response = self._pool.urlopen(
                    method, self._prefix + target, body=data, headers=headers,
                    timeout=self._timeout, redirect=False,
                )  # fmt: skip
            else:
                response = self.api.rest_client.pool_manager.request(
                    method, self.configuration.host + target, body=data, headers=headers,
                    timeout=self._timeout, redirect=False,
                )  # fmt: skip
        except OSError as exc:  # connection refused/reset, timeouts (urllib3 errors are OSError)
            raise ApiError(0, type(exc).__name__, str(exc)) from exc
        except urllib3.exceptions.HTTPError as exc:  # MaxRetryError, ProtocolError, ...
            raise ApiError(0, type(exc).__name__, str(exc)) from exc
        if not 200 <= response.status <= 299:
            raise _error(response.status, response.data, response.headers)
        if not response.data:
            return {}, response.status
        doc = json.loads(response.data)
        return (doc if isinstance(doc, dict) else {}), response.status

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", kind.path(namespace, name))
        except NotFound:
            return None

    def list(
        self, kind: Kind, namespace: str | None = None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        doc = self.request("GET", kind.path(namespace), query=query)
        return [item for item in doc.get("items") or [] if isinstance(item, dict)]

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        kind = kind_of(manifest)
        namespace = str((manifest.get("metadata") or {}).get("namespace") or "")
        return self.request("POST", kind.path(namespace), body=dict(manifest))

    def patch(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        patch: Any,
        *,
        subresource: str | None = None,
        content_type: str = MERGE_PATCH,
    ) -> dict[str, Any]:
        return self.request(
            "PATCH", kind.path(namespace, name, subresource), body=patch, content_type=content_type
        )

    def apply(
        self,
        manifest: Mapping[str, Any],
        *,
        field_manager: str,
        force: bool = True,
        subresource: str | None = None,
    ) -> Applied:
        """Server-side apply of ``manifest`` (creating it when absent) as
        ``field_manager``; ``force`` takes fields another manager owns instead of failing
        with :class:`Conflict`."""
        kind = kind_of(manifest)
        meta = manifest.get("metadata") or {}
        path = kind.path(str(meta.get("namespace") or ""), str(meta.get("name")), subresource)
        query = [("fieldManager", field_manager)] + ([("force", "true")] if force else [])
        obj, status = self._call(
            "PATCH", path, body=dict(manifest), content_type=APPLY_PATCH, query=query
        )
        return Applied(obj, created=status == 201)

    def delete(self, kind: Kind, namespace: str, name: str) -> None:
        with contextlib.suppress(NotFound):
            self.request("DELETE", kind.path(namespace, name))

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patch an InferenceService's ``.status`` (the status subresource)."""
        return self.patch(
            INFERENCE_SERVICE, namespace, name, {"status": status}, subresource="status"
        )

    def event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """Record a core/v1 Event on ``involved`` (best effort: a failure is only logged)."""
        meta = involved.get("metadata") or {}
        namespace = str(meta.get("namespace") or "default")
        now = timestamp(dt.datetime.now(dt.UTC))
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta.get('name')}.{secrets.token_hex(8)}",
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta.get("name"),
                "namespace": namespace,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.create(body)
        except ApiError as exc:
            log.warning("could not record event %s on %s: %s", reason, meta.get("name"), exc)


def load_configuration(
    kubeconfig: str | None = None, context: str | None = None
) -> kubernetes.client.Configuration:
    """In-cluster service account first, then the kubeconfig file (explicit path or
    the client's default); never touches the client's global default config."""
    configuration = kubernetes.client.Configuration()
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            return configuration
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(
        config_file=kubeconfig, context=context, client_configuration=configuration
    )
    return configuration
