"""A Kubernetes API emulator for tests and the bench: kmock, plus what a real API
server does on writes and kopf relies on.

Test support, not used by the operator at run time (it needs the ``test`` extra).
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

:class:`EmulatorThread` serves one on 127.0.0.1 in a background thread, so tests
stay synchronous and use the official client (:meth:`EmulatorThread.configuration`).
Run ``python -m splitserve_operator.emulator --port 8001`` for a standalone one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import kmock

from splitserve_operator.emulator_api import (
    ALL_VERBS,
    HISTORY,
    RESOURCES,
    Fault,
    Seen,
    merge_patch,
)
from splitserve_operator.emulator_server import KubeEmulator
from splitserve_operator.emulator_thread import EmulatorThread

__all__ = [
    "ALL_VERBS",
    "HISTORY",
    "RESOURCES",
    "EmulatorThread",
    "Fault",
    "KubeEmulator",
    "Seen",
    "main",
    "merge_patch",
]


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
