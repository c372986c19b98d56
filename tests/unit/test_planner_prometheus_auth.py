"""The planner's Prometheus credentials: a bearer token read from its file for every
query (so a rotated token is picked up), a CA bundle for the server's certificate, and
neither sent to any URL but the one they are for. Against a real HTTPS server on
127.0.0.1 with a certificate made here by openssl."""

from __future__ import annotations

import argparse
import http.server
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from splitserve_operator.commands.operator import add_arguments, prometheus_auth
from splitserve_operator.control.prometheus import (
    MetricsUnavailable,
    PrometheusAuth,
    PrometheusSource,
)

pytestmark = pytest.mark.unit

ANSWER = {"status": "success", "data": {"resultType": "vector", "result": [{"value": [0, "1.5"]}]}}


class _Prometheus(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[str | None]] = []
    token: ClassVar[str] = "t1"

    def do_GET(self) -> None:
        header = self.headers.get("Authorization")
        type(self).seen.append(header)
        if header != f"Bearer {type(self).token}":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b"unauthorized")
            return
        body = json.dumps(ANSWER).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def _serve(context: ssl.SSLContext | None) -> tuple[http.server.HTTPServer, str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Prometheus)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    scheme = "https" if context else "http"
    return server, f"{scheme}://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTPS Prometheus on 127.0.0.1, and the CA file of its certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (apt-get install openssl)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    _Prometheus.seen, _Prometheus.token = [], "t1"
    server, url = _serve(context)
    yield url, cert
    server.shutdown()
    server.server_close()


def test_the_token_is_read_for_every_query_and_the_ca_checks_the_server(
    tls: tuple[str, Path], tmp_path: Path
) -> None:
    url, ca = tls
    token = tmp_path / "token"
    token.write_text("t1\n")
    auth = PrometheusAuth(url=url, bearer_token_file=str(token), ca_file=str(ca))
    source = PrometheusSource(url, auth=auth)
    try:
        assert source.query("up") == 1.5
        _Prometheus.token = "t2"  # the token is rotated on disk
        token.write_text("t2\n")
        assert source.query("up") == 1.5
        assert _Prometheus.seen == ["Bearer t1", "Bearer t2"]
        token.unlink()
        with pytest.raises(MetricsUnavailable, match="--prometheus-bearer-token-file"):
            source.query("up")
    finally:
        source.close()


def test_without_the_ca_the_server_is_not_trusted(tls: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = tls
    token = tmp_path / "token"
    token.write_text("t1")
    source = PrometheusSource(url, auth=PrometheusAuth(url=url, bearer_token_file=str(token)))
    try:
        with pytest.raises(MetricsUnavailable, match="unreachable"):
            source.query("up")
    finally:
        source.close()
    assert _Prometheus.seen == []  # no request, and so no token, reached it


def test_credentials_go_to_their_url_only(tmp_path: Path) -> None:
    _Prometheus.seen, _Prometheus.token = [], "t1"
    server, url = _serve(None)
    try:
        token = tmp_path / "token"
        token.write_text("t1")
        auth = PrometheusAuth(
            url="https://thanos.monitoring.svc:9091", bearer_token_file=str(token)
        )
        elsewhere = PrometheusSource(url, auth=auth)  # a URL a spec named
        with pytest.raises(MetricsUnavailable, match=r"refused the query \(HTTP 401\)"):
            elsewhere.query("up")
        assert _Prometheus.seen == [None]
        elsewhere.close()
        mine = PrometheusSource(
            url + "/", auth=PrometheusAuth(url=url, bearer_token_file=str(token))
        )
        assert mine.query("up") == 1.5 and _Prometheus.seen[-1] == "Bearer t1"
        mine.close()
    finally:
        server.shutdown()
        server.server_close()
    assert PrometheusAuth(url="http://p:9090/api").covers("http://p:9090/api/")
    assert not PrometheusAuth(url="http://p:9090").covers("http://p:90901")


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flags_name_the_prometheus_the_credentials_are_for(tmp_path: Path) -> None:
    assert prometheus_auth(_flags()) is None
    with pytest.raises(SystemExit, match="need --prometheus-auth-url"):
        prometheus_auth(_flags("--prometheus-bearer-token-file", "/t"))
    with pytest.raises(SystemExit, match="needs --prometheus-bearer-token-file"):
        prometheus_auth(_flags("--prometheus-auth-url", "https://p"))
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(SystemExit, match="cannot load the Prometheus CA bundle"):
        prometheus_auth(
            _flags("--prometheus-auth-url", "https://p", "--prometheus-ca-file", str(bad))
        )
    auth = prometheus_auth(
        _flags("--prometheus-auth-url", "https://p", "--prometheus-bearer-token-file", "/t")
    )
    assert auth == PrometheusAuth(url="https://p", bearer_token_file="/t")
