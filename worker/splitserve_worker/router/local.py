"""Run a router on 127.0.0.1 in a background thread (benches, tests, embedding).

    with RouterThread(service) as base_url:
        httpx.post(f"{base_url}/v1/completions", json={...})

The thread owns its own event loop; :meth:`call` runs a coroutine on it (for
example, to look at the dispatcher from a test).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from splitserve_worker.router.app import create_app
from splitserve_worker.router.http_server import server_config
from splitserve_worker.router.service import RouterService

T = TypeVar("T")


class RouterThread(AbstractContextManager[str]):
    def __init__(self, service: RouterService, host: str = "127.0.0.1", port: int = 0) -> None:
        self.service = service
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._server: Any = None
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        import uvicorn

        loop = asyncio.new_event_loop()
        self._loop = loop
        config = server_config(
            create_app(self.service), self.host, self.port, timeout_graceful_shutdown=2
        )
        server = uvicorn.Server(config)
        self._server = server

        async def main() -> None:
            task = asyncio.create_task(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.02)
            if server.started:
                sock = server.servers[0].sockets[0]
                self.port = sock.getsockname()[1]
            self._started.set()
            await task
            await asyncio.sleep(0.2)  # let closed gRPC channels deliver their last callbacks

        try:
            loop.run_until_complete(main())
        except BaseException as e:  # reported to the starter
            self._error = e
        finally:
            self._started.set()
            loop.close()

    def start(self, ready_timeout_s: float = 120.0) -> str:
        """Starts the server; waits until a decode worker answers Health. Returns the base URL."""
        self._thread = threading.Thread(target=self._run, name="router", daemon=True)
        self._thread.start()
        if not self._started.wait(30) or self._server is None or not self._server.started:
            raise RuntimeError(f"the router did not start: {self._error!r}")
        if not self.call(self.service.wait_ready(ready_timeout_s), ready_timeout_s + 5):
            self.stop()
            raise RuntimeError(f"no decode worker became healthy within {ready_timeout_s:g} s")
        return self.base_url

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        assert self._loop is not None
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
