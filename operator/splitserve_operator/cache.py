"""The latest InferenceService bodies seen on the watch stream (an informer cache).

Fed by a kopf ``on.event`` handler; read by the Deployment-event path, the resync
loop, and whoever else needs the current spec or status without an API call.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any

Key = tuple[str, str]


class ServiceCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bodies: dict[Key, dict[str, Any]] = {}
        self._gone: dict[Key, str] = {}
        """The uid last seen deleted under each key (until a body comes back there)."""

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> Key:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        with self._lock:
            if event_type == "DELETED":
                self._bodies.pop(key, None)
                self._gone[key] = str(meta.get("uid") or "")
            else:
                self._bodies[key] = copy.deepcopy(dict(body))
                self._gone.pop(key, None)
        return key

    def deleted(self, body: Mapping[str, Any]) -> bool:
        """Whether the watch saw this very object (its uid) deleted, and nothing of its
        name since: a body read before that is stale."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        with self._lock:
            return key in self._gone and self._gone[key] == str(meta.get("uid") or "")

    def get(self, key: Key) -> dict[str, Any] | None:
        with self._lock:
            body = self._bodies.get(key)
        return copy.deepcopy(body) if body is not None else None

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._bodies)

    def __len__(self) -> int:
        with self._lock:
            return len(self._bodies)
