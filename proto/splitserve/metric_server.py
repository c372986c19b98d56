"""Serve ``/metrics`` from a process that has no HTTP server of its own: a gRPC-only
worker, and the operator (its planner's series). :func:`start_metrics_server` serves a
registry from a daemon thread; :meth:`MetricsServer.close` stops it and joins the thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

ALL_INTERFACES = "0.0.0.0"
"""Default bind address: in a pod, Prometheus scrapes the pod IP."""


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; ``port`` is the bound port (useful with port 0)."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stops serving and joins the server thread. Idempotent."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(
    port: int, registry: CollectorRegistry, host: str = ALL_INTERFACES
) -> MetricsServer:
    """Serves ``registry`` on ``http://host:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port; read it back from the returned object.
    """
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound_port = int(server.server_address[1])
    return MetricsServer(host=host, port=bound_port, _server=server, _thread=thread)
