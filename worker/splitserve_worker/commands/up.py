"""``splitserve up``: a local stack (workers and the router) on 127.0.0.1.

    splitserve up --model smollm2-135m --prefill 1 --decode 1 [--colocated K] [--demo]
                  [--prefill-tp P] [--decode-tp D] [--colocated-tp C]
    splitserve up --model smollm2-135m --flex 2

``--flex N`` adds N switchable workers (half prefill, half decode to begin with; no
fixed ones unless ``--prefill``/``--decode`` ask for them) and runs the rebalancer
(:mod:`splitserve_worker.router.rebalancer`) beside the router: it switches their roles
as the router's own TTFT, TPOT, queues and KV use ask, with the planner's policy.

Workers run as ``splitserve worker`` child processes (each prints ``READY host:port``
once it serves), each over its ``--*-tp`` rank processes; the router runs in this
process. The router's API key comes from ``--api-key-file`` or ``SPLITSERVE_API_KEY``,
the workers' token from a private file: no secret is ever on a command line (``ps``
shows those to every user of the host), and the children's environment carries no API
key. Ctrl-C (or SIGTERM) stops the
router and terminates every child; children also die with this process (Linux
parent-death signal), so none is left behind. With ``--tls-cert``, ``--tls-key`` and
``--tls-ca`` (and ``--tls-mutual``) every worker serves and calls over TLS with those
files and the router calls them with the same. ``--demo`` sends one chat question,
streams the answer, prints TTFT and TPOT, and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.roles import Role
from splitserve.tls import TlsConfig, TlsError

from splitserve_worker.commands.router import API_KEY_ENV, SECRET_ON_COMMAND_LINE, read_secret
from splitserve_worker.commands.tls_flags import add_tls_arguments, tls_args, tls_from_args
from splitserve_worker.commands.worker import METRICS_PREFIX, READY_PREFIX
from splitserve_worker.router.discovery import WorkerEndpoint

DEMO_QUESTION = "What is the capital of France? Answer in one short sentence."


class StackError(RuntimeError):
    """The local stack could not start; the message says which part and why."""


@dataclass
class WorkerProc:
    role: Role
    proc: subprocess.Popen[str]
    address: str | None = None
    metrics_port: int | None = None
    """The worker's Prometheus port, when it was started with ``--metrics-port``."""
    ready: threading.Event = field(default_factory=threading.Event)
    tail: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> WorkerEndpoint:
        assert self.address is not None
        return WorkerEndpoint(
            name=f"{self.role.value}@{self.address}", role=self.role, address=self.address
        )


class WorkerProcs(AbstractContextManager["WorkerProcs"]):
    """Starts ``splitserve worker`` processes and stops them all, whatever happens."""

    def __init__(
        self,
        model: str,
        roles: Sequence[Role],
        token: str,
        threads: int = 1,
        kv_backend: str = "tcp",
        extra_args: Sequence[str] = (),
        echo: bool = True,
        tls: TlsConfig | None = None,
        tensor_parallel: Mapping[Role, int] | None = None,
    ) -> None:
        """``tensor_parallel``: each role's ``--tensor-parallel-size`` (1 where unsaid)."""
        self.model = model
        self.tensor_parallel = dict(tensor_parallel or {})
        self.roles = list(roles)
        self.token = token
        self.threads = threads
        self.kv_backend = kv_backend
        self.extra_args = list(extra_args)
        self.tls = tls or TlsConfig()
        """Every worker's TLS files (they serve and call each other with the same ones)."""
        self.echo = echo
        self.procs: list[WorkerProc] = []
        self._dir = tempfile.TemporaryDirectory(prefix="splitserve-up-")
        self.token_file = Path(self._dir.name) / "worker-token"
        self.token_file.write_text(token)
        self.token_file.chmod(0o600)

    def command(self, role: Role) -> list[str]:
        return [
            sys.executable, "-m", "splitserve.cli", "worker",
            "--role", role.value, "--model", self.model, "--host", "127.0.0.1", "--port", "0",
            "--token-file", str(self.token_file), "--threads", str(self.threads),
            "--kv-backend", self.kv_backend, "--parent-pid", str(os.getpid()),
            *tls_args(self.tls),
            "--tensor-parallel-size", str(self.tensor_parallel.get(role, 1)),
            *self.extra_args,
        ]  # fmt: skip

    def _spawn(self, role: Role) -> WorkerProc:
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}  # not theirs to hold
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        proc = subprocess.Popen(
            self.command(role),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # Ctrl-C reaches us; we stop the children in order
        )
        wp = WorkerProc(role, proc)
        threading.Thread(target=self._read, args=(wp, len(self.procs)), daemon=True).start()
        return wp

    def _read(self, wp: WorkerProc, i: int) -> None:
        assert wp.proc.stdout is not None
        for line in wp.proc.stdout:
            line = line.rstrip("\n")
            wp.tail = [*wp.tail[-40:], line]
            if line.startswith(METRICS_PREFIX) and wp.metrics_port is None:
                wp.metrics_port = int(line[len(METRICS_PREFIX) :])
            if line.startswith(READY_PREFIX) and not wp.ready.is_set():
                wp.address = line[len(READY_PREFIX) :].strip().split()[0]
                wp.ready.set()
            if self.echo:
                print(f"[{wp.role.value}-{i}] {line}", file=sys.stderr, flush=True)
        wp.ready.set()  # the process ended: wake the waiter, which sees no address

    def start(self, timeout_s: float = 600.0) -> list[WorkerEndpoint]:
        """Starts every worker and waits until each printed READY (or fails clearly)."""
        for role in self.roles:
            self.procs.append(self._spawn(role))
        deadline = time.monotonic() + timeout_s
        for i, wp in enumerate(self.procs):
            if not wp.ready.wait(max(0.0, deadline - time.monotonic())) or wp.address is None:
                code = wp.proc.poll()
                why = f"exited with {code}" if code is not None else f"not ready in {timeout_s:g} s"
                tail = "\n".join(wp.tail[-15:])
                raise StackError(f"{wp.role.value} worker {i} {why}; its last output:\n{tail}")
        return [wp.endpoint for wp in self.procs]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        self.procs[i].proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[i].proc.wait(10)

    def stop(self, grace_s: float = 10.0) -> None:
        for wp in self.procs:
            if wp.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    wp.proc.terminate()
        deadline = time.monotonic() + grace_s
        for wp in self.procs:
            try:
                wp.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                wp.proc.kill()
                wp.proc.wait(5)
        self._dir.cleanup()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stack_roles_unchecked(prefill: int, decode: int, colocated: int) -> list[Role]:
    return [Role.PREFILL] * prefill + [Role.DECODE] * decode + [Role.BOTH] * colocated


def stack_roles(prefill: int, decode: int, colocated: int) -> list[Role]:
    roles = stack_roles_unchecked(prefill, decode, colocated)
    if not any(r in (Role.DECODE, Role.BOTH) for r in roles):
        raise StackError("a stack needs at least one decode or colocated worker")
    if prefill and not decode:
        raise StackError("prefill workers need at least one decode worker to hand their KV to")
    return roles


def stack_tensor_parallel(prefill: int, decode: int, colocated: int) -> dict[Role, int]:
    """Each role's tensor-parallel size, checked before any worker starts."""
    sizes = {Role.PREFILL: prefill, Role.DECODE: decode, Role.BOTH: colocated}
    for role, n in sizes.items():
        flag = "--colocated-tp" if role is Role.BOTH else f"--{role.value}-tp"
        if n < 1:
            raise StackError(f"{flag} must be >= 1, got {n}")
    return sizes


def check_port_free(host: str, port: int) -> None:
    """Fails early, before any worker starts, when the router's port is taken."""
    if port == 0:
        return
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise StackError(
                f"cannot listen on {host}:{port} ({e.strerror}); pass another --port, "
                "or --port 0 for any free one"
            ) from None


@contextlib.contextmanager
def _quiet_uvicorn_signals(server: Any) -> Iterator[None]:
    yield


async def serve_router(app: Any, host: str, port: int) -> tuple[Any, asyncio.Task[None], int]:
    """Starts uvicorn in this loop; returns (server, task, port) once it listens."""
    import uvicorn

    from splitserve_worker.router.http_server import server_config

    server = uvicorn.Server(server_config(app, host, port, timeout_graceful_shutdown=3))
    server.capture_signals = lambda: _quiet_uvicorn_signals(server)  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    for _ in range(600):
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    if not server.started:
        if task.done() and task.exception():
            raise StackError(f"the router did not start: {task.exception()}")
        raise StackError("the router did not start within 30 s")
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def demo(
    base: str, model: str, api_key: str | None, out: Any = sys.stdout
) -> dict[str, float]:
    """Streams one chat answer to ``out``; returns its TTFT and TPOT (seconds)."""
    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": DEMO_QUESTION}],
        "max_tokens": 64,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    print(f"> {DEMO_QUESTION}", file=out, flush=True)
    t0 = time.monotonic()
    first: float | None = None
    last = t0
    n = 0
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client,
        client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        if r.status_code != 200:
            raise StackError(f"the demo request failed: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StackError(f"the demo request failed: {chunk['error']['message']}")
            for c in chunk.get("choices", []):
                ids = c.get("token_ids") or []
                if ids:
                    now = time.monotonic()
                    first = first or now
                    last = now
                    n += len(ids)
                print(c.get("delta", {}).get("content", ""), end="", file=out, flush=True)
    print(file=out)
    if first is None:
        raise StackError("the demo request produced no tokens")
    ttft = first - t0
    tpot = (last - first) / (n - 1) if n > 1 else 0.0
    print(
        f"TTFT {ttft * 1000:.1f} ms, TPOT {tpot * 1000:.1f} ms ({n} tokens)", file=out, flush=True
    )
    return {"ttft_s": ttft, "tpot_s": tpot, "tokens": float(n)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in name or checkpoint folder")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (1; 0 with --flex)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (1; 0 with --flex)")
    p.add_argument(
        "--flex",
        type=int,
        default=0,
        help="switchable workers whose roles follow the load (see --flex-*)",
    )
    p.add_argument(
        "--flex-ttft-slo",
        type=float,
        default=1.0,
        help="TTFT objective (s) the rebalancer holds prefill to",
    )
    p.add_argument(
        "--flex-tpot-slo",
        type=float,
        default=0.05,
        help="TPOT objective (s) the rebalancer holds decode to",
    )
    p.add_argument(
        "--flex-dwell", type=float, default=10.0, help="least time between two switches (s)"
    )
    p.add_argument(
        "--flex-drain",
        type=float,
        default=2.0,
        help="how long a switching worker's streams run before they migrate (s)",
    )
    p.add_argument("--colocated", type=int, default=0, help="'both' workers (prefill and decode)")
    p.add_argument("--kv-backend", choices=("tcp", "grpc", "nixl"), default="tcp")
    p.add_argument(
        "--port", type=int, default=8000, help="router HTTP port on 127.0.0.1 (0: any free port)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker rank")
    for role, flag in (("prefill", "--prefill-tp"), ("decode", "--decode-tp"),
                       ("colocated", "--colocated-tp")):  # fmt: skip
        p.add_argument(flag, type=int, default=1, metavar="N",
                       help=f"--tensor-parallel-size of each {role} worker")  # fmt: skip
    p.add_argument(
        "--api-key-file",
        default=None,
        help=f"file holding the API key the router requires (or ${API_KEY_ENV})",
    )
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: see below
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra argument passed to every worker (repeatable)")  # fmt: skip
    p.add_argument("--demo", action="store_true", help="ask one question, print TTFT/TPOT, exit")
    add_tls_arguments(p, worker=True)  # the workers' files; the router calls them with the same


async def _main(args: argparse.Namespace) -> int:
    from splitserve_worker.commands.router import load_tokenizer
    from splitserve_worker.models import model_context_limit, resolve_model
    from splitserve_worker.router.app import create_app
    from splitserve_worker.router.config import RouterConfig
    from splitserve_worker.router.discovery import StaticDiscovery
    from splitserve_worker.router.service import RouterService

    if args.api_key is not None:
        raise StackError(SECRET_ON_COMMAND_LINE)
    try:
        api_key = read_secret(args.api_key_file, API_KEY_ENV)
    except (OSError, ValueError) as e:
        raise StackError(f"cannot read the API key: {e}") from None
    try:
        tls = tls_from_args(args)
        tls.check()
    except TlsError as e:
        raise StackError(str(e)) from None
    if tls.enabled and not (tls.serves and tls.verifies):
        raise StackError(
            "a TLS stack needs --tls-cert, --tls-key and --tls-ca: every worker serves with "
            "the certificate and calls the others checking the CA"
        )
    if args.flex < 0:
        raise StackError(f"--flex must be >= 0, got {args.flex}")
    fixed_default = 0 if args.flex else 1
    prefill = fixed_default if args.prefill is None else args.prefill
    decode = fixed_default if args.decode is None else args.decode
    flex = [Role.PREFILL] * (args.flex // 2) + [Role.DECODE] * (args.flex - args.flex // 2)
    # checked as one stack; the switchable workers come last (the rebalancer's own)
    stack_roles(prefill + flex.count(Role.PREFILL), decode + flex.count(Role.DECODE),
                args.colocated)  # fmt: skip
    roles = [*stack_roles_unchecked(prefill, decode, args.colocated), *flex]
    worker_args = [*args.worker_arg, "--switchable"] if flex else args.worker_arg
    tp = stack_tensor_parallel(args.prefill_tp, args.decode_tp, args.colocated_tp)
    check_port_free("127.0.0.1", args.port)
    # once, before any worker: a wrong name fails here, and the workers find the built-in
    # model converted (or a hub checkpoint fetched) rather than each doing it at once
    await asyncio.to_thread(resolve_model, args.model)
    token = secrets.token_hex(16)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with WorkerProcs(
        args.model, roles, token, args.threads, args.kv_backend, worker_args,
        tls=tls, tensor_parallel=tp,
    ) as procs:  # fmt: skip
        print(
            f"starting {len(roles)} workers ({', '.join(r.value for r in roles)}) ...", flush=True
        )
        starting = asyncio.ensure_future(asyncio.to_thread(procs.start))
        tokenizer = await asyncio.to_thread(load_tokenizer, args.model)
        done, _ = await asyncio.wait({starting, asyncio.ensure_future(stop.wait())},
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if starting not in done:
            print("interrupted while starting; stopping the workers", flush=True)
            return 130
        endpoints = starting.result()
        cfg = RouterConfig(
            model_name=args.model, kv_backend=args.kv_backend, worker_token=token,
            api_key=api_key, max_model_len=model_context_limit(args.model),
            tls=TlsConfig(tls.cert_file, tls.key_file, tls.ca_file, tls.server_name),
        )  # fmt: skip
        service = RouterService(cfg, tokenizer, StaticDiscovery(endpoints))
        server, task, port = await serve_router(create_app(service), "127.0.0.1", args.port)
        base = f"http://127.0.0.1:{port}"
        rebalancing: contextlib.AsyncExitStack = contextlib.AsyncExitStack()
        if flex:
            await rebalancing.enter_async_context(
                rebalancer(service, endpoints[len(endpoints) - len(flex) :], token, args)
            )
        try:
            if not await service.wait_ready(60):
                raise StackError("no decode worker answered Health within 60 s")
            key = ", API key required" if api_key else ""
            if tls.enabled:
                key += ", workers over mutual TLS" if tls.mutual else ", workers over TLS"
            print(f"router: OpenAI API on {base}/v1 (model {args.model!r}{key})", flush=True)
            for ep in endpoints:
                print(f"  worker {ep.role.value:8s} {ep.address}", flush=True)
            if args.demo:
                await demo(base, args.model, api_key)
            else:
                print("press Ctrl-C to stop", flush=True)
                await stop.wait()
        finally:
            await rebalancing.aclose()
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
    print("stopped", flush=True)
    return 0


@contextlib.asynccontextmanager
async def rebalancer(
    service: Any, flex: Sequence[WorkerEndpoint], token: str, args: argparse.Namespace
) -> AsyncIterator[Any]:
    """The rebalancer over the router's metrics and pool, switching the ``flex`` workers;
    stopped (switches under way waited for) on the way out."""
    from splitserve.role_balance import BalanceConfig
    from splitserve.v1 import worker_pb2 as pb

    from splitserve_worker.client import WorkerClients
    from splitserve_worker.router.rebalancer import FlexSettings, Rebalancer

    to_proto = {Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE, Role.BOTH: pb.ROLE_BOTH}
    address = {ep.name: ep.address for ep in flex}
    clients = WorkerClients(token)
    settings = FlexSettings(
        ttft_slo_s=args.flex_ttft_slo, tpot_slo_s=args.flex_tpot_slo, drain_s=args.flex_drain,
        balance=BalanceConfig(min_dwell_s=args.flex_dwell, sustain_s=2.0),
    )  # fmt: skip

    async def switch(name: str, role: Role) -> None:
        done = await clients.get(address[name]).switch_role(
            to_proto[role], args.flex_drain, timeout=args.flex_drain + 120.0
        )
        print(f"  worker {name} now serves {role.value} ({done.seconds:.2f} s, "
              f"{done.migrated} streams migrated)", flush=True)  # fmt: skip

    r = Rebalancer(service.metrics.registry, service.pool.snapshot, service.pool.mark_switching,
                   switch, set(address), settings)  # fmt: skip
    halt = asyncio.Event()
    loop = asyncio.create_task(r.run(halt), name="rebalancer")
    try:
        yield r
    finally:
        halt.set()
        await loop
        await r.close()
        await clients.close()


def run(args: argparse.Namespace) -> int:
    from splitserve_worker.models import ModelError

    try:
        return asyncio.run(_main(args))
    except (StackError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
