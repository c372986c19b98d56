"""The router's HTTP server: uvicorn, with bounds on connections that are slow or many
(:class:`~splitserve_worker.router.config.HttpConfig`).

uvicorn bounds idle time between requests (keep-alive) and a request head's size (h11),
but not how long a head or a body may take to arrive, nor how many connections one
client holds: a client sending its headers a byte every few seconds kept its connection
for ever, sixty of them sixty. :func:`guarded_protocol` is uvicorn's own HTTP/1.1
protocol with a head timer (from the connection's start, or from the next request's
first byte), a body timer (from the head to the body's end) and a count of connections
per client address; :func:`server_config` is the uvicorn config every way of running the
router uses (``splitserve router``, ``splitserve up``, :class:`~.local.RouterThread`).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitserve_worker.router.config import HttpConfig


def _closing_answer(status: str, body: str, *headers: str) -> bytes:
    """A whole HTTP/1.1 answer that closes its connection (sent before, or instead of,
    any request the app would see)."""
    lines = [f"HTTP/1.1 {status}", "content-type: text/plain", "connection: close", *headers,
             f"content-length: {len(body)}"]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


TIMED_OUT = _closing_answer(
    "408 Request Timeout", "the request did not arrive in time: send it whole"
)
TOO_MANY = _closing_answer(
    "503 Service Unavailable",
    "too many connections from this address: reuse one",
    "retry-after: 1",
)


def guarded_protocol(limits: HttpConfig) -> type[H11Protocol]:
    """uvicorn's h11 protocol under ``limits``; one class per server (it counts the
    connections of its server's clients)."""
    peers: collections.Counter[str] = collections.Counter()

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._read_timer: asyncio.TimerHandle | None = None
            self._reading: str | None = None
            """What the timer waits for: "head" or "body" (None: nothing to read now)."""
            self._peer: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = self.client[0] if self.client else "unknown"
            if peers[peer] >= limits.max_connections_per_peer:
                transport.write(TOO_MANY)
                transport.close()
                return
            peers[peer] += 1
            self._peer = peer
            self._arm("head", limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._peer is not None:
                peers[self._peer] -= 1
                if peers[self._peer] <= 0:
                    del peers[self._peer]
                self._peer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._reading is None and self.conn.their_state is h11.IDLE:
                self._arm("head", limits.header_timeout_s)  # the next request begins
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def _follow(self) -> None:
            """Move the timer along with what the client has sent of its request."""
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                if self._reading != "body":
                    self._arm("body", limits.body_timeout_s)
            elif state is not h11.IDLE:  # the request is in (or the connection ends)
                self._disarm()
            elif self._reading == "body":
                self._disarm()  # a new cycle: its head's timer starts with its first byte

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._reading = what
            self._read_timer = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer, self._reading = None, None

        def _timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self._reading == "head" and self.conn.our_state is h11.IDLE:
                self.transport.write(TIMED_OUT)
            self._reading = None
            self.transport.close()  # a body still awaited reads as a disconnect

    return GuardedH11Protocol


def server_config(app: Any, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn config of a router app (made by ``create_app``, which puts its
    :class:`HttpConfig` in ``app.state.http``); ``kwargs`` go to uvicorn as they are."""
    limits: HttpConfig = getattr(app.state, "http", None) or HttpConfig()
    options: dict[str, Any] = {
        "log_level": "warning",
        "access_log": False,
        "lifespan": "on",
        **kwargs,
    }
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        limit_concurrency=limits.max_connections,
        **options,
    )
