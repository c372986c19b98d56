"""The operator's API client on the wire: against a real HTTP server on 127.0.0.1 that
records what arrives and answers as an API server would. Checks what the requests carry
(path below the host URL's prefix, the bearer token, the user agent, the query, the
body as JSON) and how answers become results and errors."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes.client
import pytest
from splitserve_operator.control.k8s import (
    APPLY_PATCH,
    DEPLOYMENT,
    AlreadyExists,
    ApiError,
    KubeClient,
    NotFound,
)

pytestmark = pytest.mark.unit


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.seen: list[dict[str, Any]] = []
        self.answers: list[tuple[int, dict[str, str], Any]] = []


class Handler(BaseHTTPRequestHandler):
    server: Recorder

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        self.server.seen.append(
            {
                "method": self.command,
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": raw,
            }
        )
        status, headers, body = self.server.answers.pop(0)
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_POST = do_DELETE = _serve

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture(name="server")
def server_fixture() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


def _client(server: Recorder, prefix: str = "") -> KubeClient:
    host, port = server.server_address[:2]
    configuration = kubernetes.client.Configuration(host=f"http://{host!s}:{port}{prefix}")
    configuration.api_key = {"BearerToken": "s3cret"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    return KubeClient(configuration, user_agent="splitserve-operator/test")


def test_an_apply_carries_token_agent_query_and_json_below_the_host_prefix(
    server: Recorder,
) -> None:
    server.answers.append((201, {}, {"kind": "Deployment", "metadata": {"name": "d"}}))
    client = _client(server, prefix="/k8s/clusters/c-1/")
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns"},
        "spec": {"replicas": 2},
    }
    applied = client.apply(manifest, field_manager="me", force=True)
    assert applied.created and applied.obj["metadata"]["name"] == "d"
    (seen,) = server.seen
    assert seen["method"] == "PATCH"
    assert seen["path"] == (
        "/k8s/clusters/c-1" + DEPLOYMENT.path("ns", "d") + "?fieldManager=me&force=true"
    )
    assert seen["headers"]["authorization"] == "Bearer s3cret"
    assert seen["headers"]["user-agent"] == "splitserve-operator/test"
    assert seen["headers"]["content-type"] == APPLY_PATCH
    assert json.loads(seen["body"]) == manifest
    assert client.calls["PATCH"] == 1
    client.close()


def test_answers_become_results_and_errors(server: Recorder) -> None:
    client = _client(server)
    server.answers += [
        (404, {}, {"kind": "Status", "reason": "NotFound", "message": "gone"}),
        (409, {}, {"kind": "Status", "reason": "AlreadyExists", "message": "there"}),
        (
            429,
            {"Retry-After": "3"},
            {"kind": "Status", "reason": "TooManyRequests", "message": "slow down"},
        ),
        (200, {}, {"items": [{"metadata": {"name": "a"}}, "not an object"]}),
    ]
    assert client.get(DEPLOYMENT, "ns", "d") is None
    with pytest.raises(AlreadyExists):
        client.create(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "d", "namespace": "ns"},
            }
        )
    with pytest.raises(ApiError) as throttled:  # a write: urllib3 does not retry it itself
        client.request("POST", "/api/v1/namespaces", body={"kind": "Namespace"})
    assert throttled.value.status == 429 and throttled.value.transient
    assert throttled.value.retry_after == 3.0 and throttled.value.message == "slow down"
    assert client.list(DEPLOYMENT, "ns", label_selector="a=b") == [{"metadata": {"name": "a"}}]
    assert server.seen[-1]["path"] == DEPLOYMENT.path("ns") + "?labelSelector=a%3Db"
    with pytest.raises(NotFound):  # NotFound is an ApiError a caller can tell apart
        server.answers.append((404, {}, {"reason": "NotFound", "message": "gone"}))
        client.request("GET", DEPLOYMENT.path("ns", "d"))
    client.close()


def test_no_answer_is_a_transient_error_that_names_the_cause() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configuration = kubernetes.client.Configuration(host=f"http://127.0.0.1:{port}")
    configuration.retries = 0
    client = KubeClient(configuration, timeout=5)
    with pytest.raises(ApiError) as refused:
        client.get(DEPLOYMENT, "ns", "d")
    assert refused.value.status == 0 and refused.value.transient
    assert refused.value.reason  # the exception's type: what to look at
    client.close()
