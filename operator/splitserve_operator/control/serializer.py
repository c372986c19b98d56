"""One reconcile per InferenceService at a time: the (namespace, name) key of a
body, and :class:`Serializer`, which runs reconciles of one key in turn and
coalesces the triggers that arrive meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from splitserve_operator.api.fields import as_map

Key = tuple[str, str]
"""(namespace, name) of an InferenceService."""


def key_of(body: Mapping[str, Any]) -> Key:
    meta = as_map(body.get("metadata"))
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class Serializer:
    """Runs reconciles of one key one at a time, coalescing triggers.

    :meth:`run` runs ``fn`` now and returns its result, after any run in progress
    for the key; :meth:`nudge` asks for a run without waiting: if one is in
    progress, it runs once more when done; otherwise ``fn`` runs now in the caller.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[Key, threading.Lock] = {}
        self._dirty: set[Key] = set()

    def _lock(self, key: Key) -> threading.Lock:
        with self._mutex:
            return self._locks.setdefault(key, threading.Lock())

    def run(self, key: Key, fn: Callable[[], Any]) -> Any:
        lock = self._lock(key)
        with lock:
            with self._mutex:
                self._dirty.discard(key)
            result = fn()
            self._drain(key, fn)
            return result

    def nudge(self, key: Key, fn: Callable[[], Any]) -> bool:
        """Returns False when a run in progress will pick the nudge up instead."""
        lock = self._lock(key)
        if not lock.acquire(blocking=False):
            with self._mutex:
                self._dirty.add(key)
            return False
        try:
            with self._mutex:
                self._dirty.discard(key)
            fn()
            self._drain(key, fn)
        finally:
            lock.release()
        return True

    def _drain(self, key: Key, fn: Callable[[], Any]) -> None:
        while True:
            with self._mutex:
                if key not in self._dirty:
                    return
                self._dirty.discard(key)
            fn()

    def forget(self, key: Key) -> None:
        with self._mutex:
            self._dirty.discard(key)
            lock = self._locks.get(key)
            if lock is not None and not lock.locked():
                del self._locks[key]
