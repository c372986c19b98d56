"""Real splitserve processes for the Prometheus tests: one prefill worker, one decode
worker (``splitserve worker --role ... --metrics-port ...``) and the router
(``splitserve router``), on 127.0.0.1, plus a load generator of concurrent streaming
completions. Every child is stopped by its own pid at teardown."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from prom_fixture import ScrapeTarget, free_port

READY = "READY "


class Proc:
    def __init__(
        self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.log = log
        self._file = log.open("w")
        self.proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=self._file,
            text=True,
            bufsize=1,
            env={**os.environ, **env} if env is not None else None,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.address: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(READY) and self.address is None:
                self.address = line[len(READY) :].strip()
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start: {self.log.read_text()[-3000:]}")
        assert self.address is not None
        return self.address

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._file.close()


class LiveStack:
    """prefill + decode workers and a router, all real processes."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        labels: dict[str, str],
        *,
        worker_args: Sequence[str] = (),
        worker_env: Mapping[str, str] | None = None,
        router_args: Sequence[str] = (),
    ) -> None:
        """``worker_args``, ``worker_env``: more flags and environment for both workers
        (a fault knob); ``router_args``: more flags for the router (``--set ...``)."""
        self.model = model
        self.workdir = workdir
        self.labels = labels
        self.worker_args = list(worker_args)
        self.worker_env = worker_env
        self.router_args = list(router_args)
        self.procs: list[Proc] = []
        self.metrics_ports: dict[str, int] = {}
        self.router_port = free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "splitserve.cli", *args]

    def start(self, timeout_s: float = 300.0) -> LiveStack:
        token = self.workdir / "token"
        token.write_text(secrets.token_hex(16))
        addresses = {}
        for role in ("prefill", "decode"):
            port = free_port()
            self.metrics_ports[role] = port
            proc = Proc(
                role,
                self._cli(
                    "worker", "--role", role, "--model", str(self.model), "--dtype", "float32",
                    "--port", "0", "--metrics-port", str(port), "--token-file", str(token),
                    "--threads", "1", *self.worker_args,
                ),
                self.workdir / f"{role}.log",
                self.worker_env,
            )  # fmt: skip
            self.procs.append(proc)
        for proc in self.procs:
            addresses[proc.name] = proc.wait_ready(timeout_s)
        workers = ",".join(f"{role}={addr}" for role, addr in addresses.items())
        router = Proc(
            "router",
            self._cli(
                "router", "--model", str(self.model), "--port", str(self.router_port),
                "--workers", workers, "--token-file", str(token), "--log-level", "warning",
                *self.router_args,
            ),
            self.workdir / "router.log",
        )  # fmt: skip
        self.procs.append(router)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    break
            if router.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router did not start: {router.log.read_text()[-3000:]}")
            time.sleep(0.2)
        return self

    def targets(self) -> list[ScrapeTarget]:
        out = [
            ScrapeTarget(f"127.0.0.1:{port}", {**self.labels, "pool": role})
            for role, port in self.metrics_ports.items()
        ]
        out.append(ScrapeTarget(f"127.0.0.1:{self.router_port}", {**self.labels, "pool": "router"}))
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


class Load:
    """``concurrency`` clients, each sending streaming completions back to back."""

    def __init__(
        self, base_url: str, concurrency: int, max_tokens: int = 48, prompt_tokens: int = 24
    ) -> None:
        self.base_url = base_url
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.prompt = [(i * 7919) % 250 + 5 for i in range(prompt_tokens)]
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(concurrency)
        ]

    def _client(self, i: int) -> None:
        body = {
            "prompt": [*self.prompt, i],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(base_url=self.base_url, timeout=120) as http:
            while not self._stop.is_set():
                try:
                    with http.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            self.errors.append(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                            time.sleep(0.5)
                            continue
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                json.loads(line[6:])
                    self.done += 1
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    time.sleep(0.5)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
