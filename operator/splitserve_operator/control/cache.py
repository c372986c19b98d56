"""The latest InferenceService bodies seen on the watch stream (an informer cache).

Fed by a kopf ``on.event`` handler; read by the Deployment-event path, the resync
loop, and whoever else needs the current spec or status without an API call.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any

from splitserve_operator.api.fields import as_map
from splitserve_operator.control.serializer import Key, key_of


def _version(body: Mapping[str, Any]) -> object:
    return as_map(body.get("metadata")).get("resourceVersion")


def _uid(body: Mapping[str, Any]) -> str:
    return str(as_map(body.get("metadata")).get("uid") or "")


class ServiceCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bodies: dict[Key, dict[str, Any]] = {}
        self._gone: dict[Key, str] = {}
        """The uid last seen deleted under each key (until a body comes back there)."""

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> Key:
        key = key_of(body)
        with self._lock:
            if event_type == "DELETED":
                self._bodies.pop(key, None)
                self._gone[key] = _uid(body)
            else:
                self._bodies[key] = copy.deepcopy(dict(body))
                self._gone.pop(key, None)
        return key

    def refresh(self, body: Mapping[str, Any], *, since: object) -> bool:
        """Replace the cached body with ``body`` (the answer to the operator's own write)
        if the cache still holds version ``since``, the one that write started from: a
        newer body the watch brought meanwhile wins. kopf holds an object's events back
        while one of its change handlers runs, so without this a reconcile that runs
        again at once would start from the body before its own status write."""
        key = key_of(body)
        with self._lock:
            current = self._bodies.get(key)
            if current is None or _version(current) != since:
                return False
            self._bodies[key] = copy.deepcopy(dict(body))
            return True

    def deleted(self, body: Mapping[str, Any]) -> bool:
        """Whether the watch saw this very object (its uid) deleted, and nothing of its
        name since: a body read before that is stale."""
        key = key_of(body)
        with self._lock:
            return key in self._gone and self._gone[key] == _uid(body)

    def get(self, key: Key) -> dict[str, Any] | None:
        with self._lock:
            body = self._bodies.get(key)
        return copy.deepcopy(body) if body is not None else None

    def peek(self, key: Key) -> Mapping[str, Any] | None:
        """The cached body itself, not a copy: read it, never change it. For the checks
        that run on every child event (a copy of a whole body each time adds up). Safe to
        keep: the cache replaces a body, it never changes one in place."""
        with self._lock:
            return self._bodies.get(key)

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._bodies)

    def __len__(self) -> int:
        with self._lock:
            return len(self._bodies)
