"""A real Prometheus server for integration tests (Debian's ``prometheus`` binary).

Started on a free 127.0.0.1 port with a temporary config and TSDB, scraping every
second the targets listed in a ``file_sd`` file (:meth:`PrometheusServer.set_targets`
rewrites it and Prometheus picks it up within a second). Where the binary is
absent the tests that need it skip with the reason, except under ``CI``, where
they fail: CI installs it (``make system-deps``).

Import into a test module: ``from prom_fixture import PrometheusServer, prometheus``
(``tests/support`` is on pytest's ``pythonpath``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from splitserve_operator.control.prometheus import parse_scalar

SCRAPE_INTERVAL = "1s"
MISSING = (
    "the prometheus binary is not installed (Debian: apt-get install --no-install-recommends "
    "prometheus; `make test` installs it through its system-deps target)"
)


def prometheus_binary() -> str:
    """The binary's path; skips the test where it is absent (fails under CI)."""
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"{MISSING}; CI must run the Prometheus tests", pytrace=False)
        pytest.skip(MISSING)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ScrapeTarget:
    address: str
    """host:port serving /metrics."""
    labels: Mapping[str, str] = field(default_factory=dict)
    path: str = "/metrics"


class PrometheusServer:
    def __init__(
        self,
        workdir: Path,
        binary: str | None = None,
        rules: Mapping[str, Any] | None = None,
    ) -> None:
        """``rules``: a rule file's content (``{"groups": [...]}``) to evaluate every
        second, as a PrometheusRule's ``spec`` holds it."""
        self.workdir = workdir
        self.rules = rules
        self.binary = binary or prometheus_binary()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets_file = workdir / "targets.json"
        self.log_file = workdir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._http = httpx.Client(timeout=10)

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.set_targets([])
        config = self.workdir / "prometheus.yml"
        rule_files: list[str] = []
        if self.rules is not None:
            rules_file = self.workdir / "rules.json"
            rules_file.write_text(json.dumps(self.rules))  # JSON is YAML
            rule_files.append(str(rules_file))
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "rule_files": rule_files,
                    "global": {
                        "scrape_interval": SCRAPE_INTERVAL,
                        "scrape_timeout": SCRAPE_INTERVAL,
                        "evaluation_interval": SCRAPE_INTERVAL,
                    },
                    "scrape_configs": [
                        {
                            "job_name": "splitserve",
                            "file_sd_configs": [
                                {"files": [str(self.targets_file)], "refresh_interval": "1s"}
                            ],
                        }
                    ],
                }
            )
        )
        with self.log_file.open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=2h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_file.read_text()[-2000:]}")
            try:
                if self._http.get(f"{self.url}/-/ready").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready in {timeout_s} s")

    def set_targets(self, targets: Sequence[ScrapeTarget]) -> None:
        groups = [
            {"targets": [t.address], "labels": {**t.labels, "__metrics_path__": t.path}}
            for t in targets
        ]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)  # atomic: Prometheus never reads half a file

    def query(self, promql: str) -> dict[str, Any]:
        """The raw ``/api/v1/query`` answer (errors included, not raised)."""
        response = self._http.get(f"{self.url}/api/v1/query", params={"query": promql})
        payload: dict[str, Any] = response.json()
        return payload

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts Prometheus holds now (``/api/v1/alerts``), pending and firing."""
        payload = self._http.get(f"{self.url}/api/v1/alerts").json()
        assert payload.get("status") == "success", payload
        return list(payload["data"]["alerts"])

    def value(self, promql: str) -> float | None:
        return parse_scalar(self.query(promql))

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[float | None], bool] = lambda v: v is not None,
        timeout_s: float = 30.0,
    ) -> float | None:
        deadline = time.monotonic() + timeout_s
        value = self.value(promql)
        while not predicate(value):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting on {promql!r} (last {value!r})")
            time.sleep(0.5)
            value = self.value(promql)
        return value

    def stop(self) -> None:
        self._http.close()
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
