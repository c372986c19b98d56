"""Where the workers are: one interface, a static list and Kubernetes.

A :class:`Discovery` yields the full set of workers each time it changes. The
static one yields once; the Kubernetes one lists the pods matching a label
selector, then watches them, and yields a new set whenever a pod becomes
ready, changes or goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.roles import Role

log = logging.getLogger(__name__)

ROLE_LABEL = "splitserve.io/role"
"""Pod label naming the worker's role: prefill, decode or both."""
PORT_NAME = "grpc"
"""Name of the container port the worker serves gRPC on."""
DEFAULT_PORT = 50051


class DiscoveryError(ValueError):
    """A worker list could not be understood; the message shows the expected form."""


@dataclass(frozen=True, order=True)
class WorkerEndpoint:
    name: str
    role: Role
    address: str
    """host:port of the worker's gRPC server."""


class Discovery(Protocol):
    def watch(self) -> AsyncIterator[list[WorkerEndpoint]]:
        """Yields the complete worker set, first at once and then on every change."""
        ...


def parse_static(spec: str) -> list[WorkerEndpoint]:
    """``prefill=127.0.0.1:7001,decode=127.0.0.1:7002,both=host:port`` -> endpoints."""
    out: list[WorkerEndpoint] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        role_s, sep, addr = item.partition("=")
        if not sep:
            raise DiscoveryError(
                f"worker {item!r} must look like ROLE=HOST:PORT (ROLE: prefill, decode, both)"
            )
        try:
            role = Role(role_s.strip())
        except ValueError:
            raise DiscoveryError(
                f"unknown role {role_s!r} in {item!r}; use prefill, decode or both"
            ) from None
        host, colon, port = addr.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DiscoveryError(f"address {addr!r} in {item!r} must be HOST:PORT")
        out.append(
            WorkerEndpoint(name=f"{role.value}@{addr.strip()}", role=role, address=addr.strip())
        )
    if not out:
        raise DiscoveryError(
            "no workers given: pass e.g. --workers prefill=127.0.0.1:7001,decode=127.0.0.1:7002"
        )
    if len({w.address for w in out}) != len(out):
        raise DiscoveryError("the same address is listed twice")
    return out


class StaticDiscovery:
    def __init__(self, endpoints: Iterable[WorkerEndpoint]) -> None:
        self.endpoints = sorted(endpoints)

    async def watch(self) -> AsyncIterator[list[WorkerEndpoint]]:
        yield list(self.endpoints)
        await asyncio.Event().wait()  # the set never changes; wait until cancelled


# ---- Kubernetes ----


def _get(obj: Any, *path: str) -> Any:
    """Reads attributes of client objects or keys of plain dicts alike."""
    for p in path:
        if obj is None:
            return None
        obj = obj.get(p) if isinstance(obj, Mapping) else getattr(obj, p, None)
    return obj


_JSON_NAMES = {"pod_ip": "podIP"}


def _camel(name: str) -> str:
    if name in _JSON_NAMES:
        return _JSON_NAMES[name]
    first, *rest = name.split("_")
    return first + "".join(r.title() for r in rest)


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(_camel(name), obj.get(name))
    return getattr(obj, name, None)


def endpoint_from_pod(pod: Any, role_label: str = ROLE_LABEL) -> WorkerEndpoint | None:
    """The endpoint of a ready, running worker pod; None for any other pod."""
    meta = _field(pod, "metadata")
    status = _field(pod, "status")
    spec = _field(pod, "spec")
    if meta is None or status is None:
        return None
    if _field(meta, "deletion_timestamp"):
        return None
    labels = _field(meta, "labels") or {}
    try:
        role = Role(labels.get(role_label, ""))
    except ValueError:
        return None
    if _field(status, "phase") != "Running":
        return None
    ip = _field(status, "pod_ip")
    if not ip:
        return None
    ready = any(
        _field(c, "type") == "Ready" and _field(c, "status") == "True"
        for c in (_field(status, "conditions") or [])
    )
    if not ready:
        return None
    port = DEFAULT_PORT
    for c in (_field(spec, "containers") or []) if spec is not None else []:
        for p in _field(c, "ports") or []:
            if _field(p, "name") == PORT_NAME:
                port = int(_field(p, "container_port"))
    name = f"{_field(meta, 'namespace') or ''}/{_field(meta, 'name')}"
    host = f"[{ip}]" if ":" in ip else ip
    return WorkerEndpoint(name=name, role=role, address=f"{host}:{port}")


class KubernetesDiscovery:
    """Pods in ``namespace`` matching ``selector``, listed then watched.

    ``api`` is a ``kubernetes.client.CoreV1Api``; the blocking watch runs on its
    own thread and hands each change to the event loop.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        selector: str,
        role_label: str = ROLE_LABEL,
        watch_timeout_s: int = 60,
        retry_s: float = 2.0,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.selector = selector
        self.role_label = role_label
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self._stop = threading.Event()

    def _run(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue[list[WorkerEndpoint]]) -> None:
        from kubernetes import watch

        pods: dict[str, Any] = {}

        def publish() -> None:
            eps = sorted(
                e for e in (endpoint_from_pod(p, self.role_label) for p in pods.values()) if e
            )
            loop.call_soon_threadsafe(q.put_nowait, eps)

        while not self._stop.is_set():
            try:
                listed = self.api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                pods = {_get(p, "metadata", "name"): p for p in listed.items}
                publish()
                version = _get(listed, "metadata", "resource_version")
                w = watch.Watch()
                kwargs: dict[str, Any] = {
                    "label_selector": self.selector,
                    "timeout_seconds": self.watch_timeout_s,
                    # the client gives up too, so a stop is noticed even on a quiet watch
                    "_request_timeout": self.watch_timeout_s + 1,
                }
                if version:
                    kwargs["resource_version"] = version
                for ev in w.stream(self.api.list_namespaced_pod, self.namespace, **kwargs):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = ev["object"]
                    name = _get(obj, "metadata", "name")
                    if ev["type"] == "DELETED":
                        pods.pop(name, None)
                    else:
                        pods[name] = obj
                    publish()
            except Exception as e:  # the API server went away or the watch timed out: list again
                if "timed out" in str(e).lower():
                    continue
                log.warning("worker discovery: %s; listing again in %.0f s", e, self.retry_s)
                self._stop.wait(self.retry_s)

    async def watch(self) -> AsyncIterator[list[WorkerEndpoint]]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[list[WorkerEndpoint]] = asyncio.Queue()
        self._stop.clear()
        thread = threading.Thread(target=self._run, args=(loop, q), daemon=True, name="discovery")
        thread.start()
        last: list[WorkerEndpoint] | None = None
        try:
            while True:
                eps = await q.get()
                if eps != last:
                    last = eps
                    yield eps
        finally:
            self._stop.set()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(thread.join, 1.0)
