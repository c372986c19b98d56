"""A worker's gRPC port: the server every port of the contract is (the worker token
checked on each call before its message is read, TLS only when the worker serves it,
the bounds of :data:`~splitserve.grpc_options.SERVER_OPTIONS`), bound or refused with a
message naming the flag to change.

Rank 0 serves the whole contract on one (:mod:`.app`); each other rank of a decode
worker split over tensor-parallel ranks serves ``PushKV`` into its own pool on one of
its own (:mod:`.rank_kv`), on a thread and event loop of its own
(:class:`ServerThread`), since a rank's main thread runs the forwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

import grpc
from splitserve.grpc_options import SERVER_OPTIONS
from splitserve.tls import TlsConfig

from splitserve_worker.server.auth import TokenAuthInterceptor

START_TIMEOUT_S = 30.0
"""Longest a :class:`ServerThread` waits for its server to listen."""
STOP_GRACE_S = 1.0
"""How long calls under way get when a :class:`ServerThread` stops."""


def listen(
    host: str, port: int, token: str, tls: TlsConfig, flag: str
) -> tuple[grpc.aio.Server, int]:
    """A server bound to ``host:port`` (0: any free port) and the port it got; not started.
    ``flag``: the option that chose ``port``, named when it cannot be bound."""
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token)], options=SERVER_OPTIONS)
    bind = f"{host}:{port}"
    try:
        if tls.serves:  # TLS only (mutual when configured): no plain port
            bound = server.add_secure_port(bind, tls.grpc_server_credentials())
        else:
            bound = server.add_insecure_port(bind)
    except RuntimeError:  # gRPC's "Failed to bind"
        raise OSError(
            f"cannot listen on {host}:{port}: the port is taken or the address is not this "
            f"host's; choose another {flag} or --host"
        ) from None
    return server, bound


class ServerThread:
    """A :func:`listen` server with the handlers ``register`` adds, served on a thread
    and event loop of its own until :meth:`close`."""

    def __init__(self, register: Callable[[grpc.aio.Server], None], host: str, port: int,
                 token: str, tls: TlsConfig, flag: str, name: str) -> None:  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(register, host, port, token,
                                        tls, flag, started), name=name, daemon=True)  # fmt: skip
        self._thread.start()
        self.port = started.result(START_TIMEOUT_S)
        """The port it listens on."""

    def _run(self, register: Callable[[grpc.aio.Server], None], host: str, port: int,
             token: str, tls: TlsConfig, flag: str,
             started: concurrent.futures.Future[int]) -> None:  # fmt: skip
        asyncio.set_event_loop(self._loop)
        try:
            server, bound = listen(host, port, token, tls, flag)
            register(server)
            self._loop.run_until_complete(server.start())
        except BaseException as e:  # said to the starting thread, which raises it
            started.set_exception(e)
            self._loop.close()
            return
        started.set_result(bound)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(server.stop(STOP_GRACE_S))
            self._loop.close()
            self._stopped.set()

    def close(self) -> None:
        """Stop serving (calls under way get :data:`STOP_GRACE_S`) and end the thread."""
        if self._thread.is_alive() and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._stopped.wait(START_TIMEOUT_S)
