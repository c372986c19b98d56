"""Serves a :class:`kube_emulator.KubeEmulator` on 127.0.0.1 from a background thread
and loop, so tests stay synchronous and use the official client."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import kmock
import kubernetes.client
from kube_emulator import Fault, KubeEmulator, Seen


class EmulatorThread:
    """Serve a :class:`KubeEmulator` over HTTP from a background thread and loop."""

    def __init__(
        self, emulator: KubeEmulator | None = None, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        # an emulator holding no objects is falsy (kmock gives it a length)
        self.emulator = emulator if emulator is not None else KubeEmulator()
        self.host = host
        self.port = port
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kube-emulator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        async with (
            self.emulator,
            kmock.Server(self.emulator, host=self.host, port=self.port or None) as server,
        ):
            self.url = str(server.url).rstrip("/")
            self.port = server.port
            self._ready.set()
            await self._stopping.wait()

    def start(self) -> EmulatorThread:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None or not self.url:
            raise RuntimeError("the Kubernetes emulator did not start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(30)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def configuration(self) -> kubernetes.client.Configuration:
        """A client configuration pointing at this emulator (no kubeconfig, no env)."""
        configuration = kubernetes.client.Configuration(host=self.url)
        configuration.connection_pool_maxsize = 32
        return configuration

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the emulator's loop (safe access to its state) and return its result."""
        assert self._loop is not None
        future: Future[Any] = Future()

        def _run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(_run)
        return future.result(30)

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Live objects of ``resource`` (e.g. ``apps/v1/deployments``), as plain dicts."""
        wanted = kmock.resource(resource)

        def _collect() -> list[dict[str, Any]]:
            out = []
            for (res, ns, _name), obj in self.emulator.objects.items():
                if res == wanted and not obj.deleted and (namespace is None or ns == namespace):
                    out.append(copy.deepcopy(obj.raw))
            return out

        return list(self.call(_collect))

    def requests(self) -> list[Seen]:
        """Every request served so far, oldest first."""
        return list(self.call(lambda: list(self.emulator.log)))

    def add_fault(self, fault: Fault) -> None:
        self.call(lambda: self.emulator.faults.append(fault))

    def clear_faults(self) -> None:
        self.call(self.emulator.faults.clear)
