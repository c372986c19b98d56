"""The stack that fault tests run: workers and the router as real processes, with relays.

Workers start through ``splitserve up``'s own helper (:class:`WorkerProcs`); the router
runs as ``splitserve router`` in its own process. Between the router and each worker
sits a :class:`Relay` (a TCP relay on 127.0.0.1) so a test can cut the router's
connections to one worker while the worker itself stays up. Every line any process
prints is kept, so tests can also read the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import httpx
from splitserve.roles import Role
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.commands.up import WorkerProc, WorkerProcs
from splitserve_worker.kv.faults import ENV_HOLD_DIR, hold_files

LEASE_S = 3.0
"""Lease on reserved blocks (workers and router); faults are judged against it."""

ROUTER_CONFIG: dict[str, Any] = {
    "max_retries": 3,
    "block_size": 16,
    "max_model_len": 2048,
    # prefill remotely whenever a prefill worker exists, so handoffs are what is tested
    "cost": {"short_prompt_tokens": 0, "prefill_tokens_per_s": 1.0e7},
    # the default wait for a slot: with one prefill worker of two killed, a loaded machine
    # takes more than a few seconds to work 50 prompts through the other, and a queue that
    # refused them then would be shedding load, not the fault under test (a scenario's
    # own client bound is what catches a request that hangs)
    "queues": {"max_wait_s": 30.0},
    "timeouts": {
        "connect_s": 2.0,
        "prefill_s": 10.0,
        "first_token_s": 10.0,
        "inter_token_s": LEASE_S,
        "request_s": 60.0,
        "lease_s": LEASE_S,
        "health_interval_s": 0.3,
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- relay


class Relay:
    """A TCP relay ``127.0.0.1:<port>`` -> ``target`` that can cut every connection."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self.drops = 0
        threading.Thread(target=self._accept, daemon=True, name=f"relay-{self.address}").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            host, _, port = self.target.rpartition(":")
            try:
                upstream = socket.create_connection((host, int(port)), timeout=2.0)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)

    def drop(self) -> int:
        """Resets every open connection (new ones are still relayed); returns how many."""
        with self._lock:
            conns = list(self._open)
            self._open.clear()
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        self.drops += len(conns)
        return len(conns)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        self.drop()


# ---------------------------------------------------------------- processes


class CapturingWorkerProcs(WorkerProcs):
    """``splitserve up``'s worker helper, keeping every line each worker prints."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lines: list[str] = []

    def _read(self, wp: WorkerProc, i: int) -> None:
        assert wp.proc.stdout is not None
        for line in wp.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(f"[{wp.role.value}-{i}] {line}")
            wp.tail = [*wp.tail[-40:], line]
            if line.startswith("READY ") and not wp.ready.is_set():
                wp.address = line[len("READY ") :].strip().split()[0]
                wp.ready.set()
        wp.ready.set()


@dataclass
class Outcome:
    """How one client request ended."""

    index: int
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_body: dict[str, Any] | None = None
    seconds: float = 0.0
    hung: bool = False

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None


@dataclass
class Stack:
    procs: CapturingWorkerProcs
    relays: list[Relay]
    router: subprocess.Popen[str]
    base_url: str
    token: str
    api_key: str | None
    workdir: Path
    router_lines: list[str] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)

    @property
    def roles(self) -> list[Role]:
        return [wp.role for wp in self.procs.procs]

    def address(self, i: int) -> str:
        addr = self.procs.procs[i].address
        assert addr is not None
        return addr

    def alive(self, i: int) -> bool:
        return self.procs.procs[i].proc.poll() is None

    def survivors(self) -> list[int]:
        return [i for i in range(len(self.relays)) if self.alive(i) and i not in self.stopped]

    def kill(self, i: int) -> None:
        self.procs.kill(i, signal.SIGKILL)

    def freeze(self, i: int) -> None:
        self.procs.procs[i].proc.send_signal(signal.SIGSTOP)
        self.stopped.add(i)

    def thaw(self, i: int) -> None:
        self.procs.procs[i].proc.send_signal(signal.SIGCONT)
        self.stopped.discard(i)

    def _hold_files(self, i: int, point: str) -> tuple[Path, Path]:
        """Worker ``i``'s files for hold ``point`` (see ``kv.faults.Holds``)."""
        pid = self.procs.procs[i].proc.pid
        armed, reached = hold_files(str(self.workdir / "holds"), pid, point)
        return Path(armed), Path(reached)

    def hold(self, i: int, point: str) -> Path:
        """Arms hold ``point`` on worker ``i``; returns the file whose removal lets it go on."""
        armed, reached = self._hold_files(i, point)
        armed.parent.mkdir(parents=True, exist_ok=True)
        reached.unlink(missing_ok=True)
        armed.touch()
        return armed

    def reached(self, i: int, point: str) -> bool:
        """Whether worker ``i`` has stopped at hold ``point`` since it was armed."""
        return self._hold_files(i, point)[1].exists()

    def logs(self) -> list[str]:
        return [*self.procs.lines, *(f"[router] {line}" for line in self.router_lines)]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def health(self, i: int, timeout: float = 3.0) -> pb.HealthResponse:
        async with WorkerClient(self.address(i), self.token, timeout=timeout) as c:
            return await c.health()

    async def baseline(self) -> dict[int, int]:
        """Free blocks of every worker now (call it while the stack is idle)."""
        return {i: (await self.health(i)).free_blocks for i in range(len(self.relays))}

    async def baseline_of(self, workers: Sequence[int]) -> dict[int, int]:
        return {i: (await self.health(i)).free_blocks for i in workers}

    async def wait_settled(
        self, baseline: Mapping[int, int], timeout: float = 4 * LEASE_S + 10
    ) -> dict[int, pb.HealthResponse]:
        """Waits until every surviving worker holds no request and all its blocks are
        free again; returns their last Health answers (the test asserts on them)."""
        deadline = time.monotonic() + timeout
        last: dict[int, pb.HealthResponse] = {}
        while True:
            for i in self.survivors():
                with contextlib.suppress(Exception):
                    last[i] = await self.health(i)
            settled = all(
                i in last
                and last[i].free_blocks == baseline[i]
                and last[i].leases == 0
                and last[i].running == 0
                and last[i].waiting == 0
                for i in self.survivors()
            )
            if settled or time.monotonic() > deadline:
                return {i: last[i] for i in self.survivors() if i in last}
            await asyncio.sleep(0.2)

    async def wait_router_sees(self, healthy: Sequence[int], timeout: float = 30.0) -> None:
        """Waits until the router reports exactly the workers ``healthy`` as healthy."""
        want = {self.relays[i].address for i in healthy}
        deadline = time.monotonic() + timeout
        body: Any = None
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    r = await client.get(f"{self.base_url}/health", headers=self.headers())
                    body = r.json()
                    seen = {w["name"].split("@", 1)[1] for w in body["workers"] if w["healthy"]}
                    if seen == want:
                        return
                await asyncio.sleep(0.2)
        raise AssertionError(f"the router never saw exactly {sorted(want)} healthy: {body}")

    async def gaps(self) -> list[str]:
        """What keeps this stack from being whole: a worker dead or frozen, the router
        gone or not seeing every worker healthy, a worker holding a lease, a request or
        a block. Empty: the stack is as it started."""
        found = [f"worker {i} ({self.roles[i].value}) is frozen" for i in sorted(self.stopped)]
        found += [
            f"worker {i} ({self.roles[i].value}) is dead"
            for i in range(len(self.relays))
            if not self.alive(i)
        ]
        if self.router.poll() is not None:
            found.append(f"the router exited with {self.router.returncode}")
        if found:
            return found
        for i in range(len(self.relays)):
            try:
                h = await self.health(i)
            except grpc.aio.AioRpcError as e:
                found.append(f"worker {i} does not answer Health: {e.code().name}")
                continue
            if (h.free_blocks, h.leases, h.running, h.waiting) != (h.total_blocks, 0, 0, 0):
                found.append(
                    f"worker {i} holds something: free {h.free_blocks}/{h.total_blocks}, "
                    f"leases {h.leases}, running {h.running}, waiting {h.waiting}"
                )
        try:
            await self.wait_router_sees(range(len(self.relays)), timeout=15.0)
        except AssertionError as e:
            found.append(str(e))
        return found

    def stop(self) -> None:
        for i in list(self.stopped):
            self.thaw(i)
        if self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait(5)
        for r in self.relays:
            r.close()
        self.procs.stop(grace_s=5.0)


def start_stack(
    model: Path,
    roles: Sequence[Role],
    workdir: Path,
    *,
    token: str | None = None,
    api_key: str | None = None,
    worker_env: Mapping[str, str] | None = None,
    worker_args: Sequence[str] = (),
    router_config: Mapping[str, Any] | None = None,
    router_log_level: str = "info",
    tensor_parallel: Mapping[Role, int] | None = None,
) -> Stack:
    token = token or secrets.token_hex(16)
    env = {ENV_HOLD_DIR: str(workdir / "holds"), **(worker_env or {})}
    args = ["--lease-seconds", str(LEASE_S), "--num-blocks", "400", *worker_args]
    procs = CapturingWorkerProcs(str(model), roles, token, threads=1, extra_args=args, echo=False,
                                 tensor_parallel=tensor_parallel)  # fmt: skip
    relays: list[Relay] = []
    router: subprocess.Popen[str] | None = None
    try:
        with mock.patch.dict(os.environ, env):
            endpoints = procs.start(timeout_s=180.0)
        relays = [Relay(ep.address) for ep in endpoints]
        spec = ",".join(
            f"{ep.role.value}={r.address}" for ep, r in zip(endpoints, relays, strict=True)
        )
        cfg_file = workdir / "router.json"
        cfg_file.write_text(json.dumps(router_config or ROUTER_CONFIG))
        cmd = [sys.executable, "-m", "splitserve.cli", "router", "--model", str(model),
               "--workers", spec, "--token-file", str(procs.token_file), "--config",
               str(cfg_file), "--host", "127.0.0.1", "--port", str(port := free_port()),
               "--log-level", router_log_level]  # fmt: skip
        if api_key:
            key_file = workdir / "api-key"
            key_file.write_text(api_key)
            cmd += ["--api-key-file", str(key_file)]
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
        stack = Stack(procs, relays, router, f"http://127.0.0.1:{port}", token, api_key, workdir)

        def read() -> None:
            assert router is not None and router.stdout is not None
            for line in router.stdout:
                stack.router_lines.append(line.rstrip("\n"))

        threading.Thread(target=read, daemon=True).start()
        asyncio.run(stack.wait_router_sees(range(len(relays)), timeout=90.0))
        return stack
    except BaseException:
        if router is not None and router.poll() is None:
            router.kill()
            router.wait(5)
        for r in relays:
            r.close()
        procs.stop(grace_s=3.0)
        raise
