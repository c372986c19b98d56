"""The operator's liveness endpoint (``--liveness http://0.0.0.0:8080/healthz``): served
from its own thread for the whole life of the process, leader or standby, since a standby
never starts kopf. It answers 200 while every registered heartbeat is recent (the event
loop's, the leader election's) and 503 once one stops, so a wedged operator is restarted."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit


class Heartbeats:
    """Named beats, each expected at least every ``max_age`` seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, float]] = {}

    def beat(self, name: str, max_age: float) -> None:
        with self._lock:
            self._last[name] = (self._clock(), max_age)

    def stale(self) -> list[str]:
        """Names whose last beat is older than their ``max_age``."""
        now = self._clock()
        with self._lock:
            return sorted(n for n, (at, age) in self._last.items() if now - at > age)


class HealthServer:
    def __init__(self, endpoint: str, heartbeats: Heartbeats) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme != "http" or parts.port is None:
            raise ValueError(f"{endpoint!r}: the liveness endpoint is http://HOST:PORT/PATH")
        self.path = parts.path or "/healthz"
        self.heartbeats = heartbeats
        health = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != health.path:
                    self.send_error(404)
                    return
                stale = health.heartbeats.stale()
                body = (f"stale: {', '.join(stale)}\n" if stale else "ok\n").encode()
                self.send_response(503 if stale else 200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:  # probes every few seconds: quiet
                pass

        self._server = http.server.ThreadingHTTPServer((parts.hostname or "", parts.port), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="splitserve-health", daemon=True
        )

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
