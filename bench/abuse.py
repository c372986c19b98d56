"""Abuse: what hostile requests cost the streams of everyone else, on a local stack.

The stack is a prefill worker, ``--decode`` decode workers (1 by default) and
``splitserve router``, each in its own process on 127.0.0.1, on the tiny test model
unless ``--model`` names another. In each scenario 20 normal clients (``--streams``)
stream completions back to back while an attacker, in a process of its own, sends:

- ``quiet``: nothing (the normal streams' own pace, for comparison);
- ``big-prompt``: a 60 MB text prompt (``--big-mb``);
- ``surrogates``: 64 requests at once whose stop string is a lone surrogate
  (``"stop": ["\\ud800"]``), half of them streamed;
- ``grpc-flood``: 64 gRPC calls without the worker token, 63 MB each, spread over the
  workers (8 in flight at a time).

Per scenario it prints the normal streams' largest gap between two tokens less their
own decode time (the stream's median gap), over every stream; the workers the router
marked down (its log); the KV blocks still held once every request has ended (each
worker's Health: total less free, and leases); the attack's answers; the router's peak
resident memory; and for ``grpc-flood`` the slowest authenticated Health of an attacked
worker meanwhile.

    uptime; .venv/bin/python bench/abuse.py

Ends with ``RESULT worst_gap_s=<s> workers_marked_down=<n> leaked_blocks=<n>`` over the
attack scenarios (targets: at most 1.5, 0, 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from router_ready import wait_healthy
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs

SCENARIOS = ("quiet", "big-prompt", "surrogates", "grpc-flood")
DOWN_WORDS = ("marked unhealthy", "failed its health check")
"""What the router logs when it takes a worker out of the pool."""


# ---- the attacker (its own process: its CPU is not the clients') ----


async def attack_big_prompt(base: str, mb: int) -> str:
    text = "All work and no play makes Jack a dull boy. " * (mb * 1_000_000 // 44)
    body = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    async with httpx.AsyncClient(timeout=600) as c:
        r = await c.post(f"{base}/v1/completions", content=body,
                         headers={"content-type": "application/json"})  # fmt: skip
        return f"{len(body) / 1e6:.0f} MB prompt: {r.status_code} {r.json()['error']['code']}"


async def attack_surrogates(base: str, n: int = 64) -> str:
    bodies = [
        '{"prompt": "Say something.", "max_tokens": 8, "stop": ["\\ud800"]'
        + (', "stream": true}' if i % 2 else "}")
        for i in range(n)
    ]
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as c:
        answers = await asyncio.gather(*(
            c.post(f"{base}/v1/completions", content=b.encode(),
                   headers={"content-type": "application/json"})
            for b in bodies))  # fmt: skip
    codes: dict[int, int] = {}
    for r in answers:
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
    return f"{n} lone-surrogate requests: status {codes}"


async def attack_grpc(addresses: list[str], n: int = 64, mb: int = 63, at_once: int = 8) -> str:
    import grpc
    from splitserve.grpc_options import CHANNEL_OPTIONS

    junk = b"\x42" * (mb << 20)
    gate = asyncio.Semaphore(at_once)
    codes: dict[str, int] = {}
    channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]

    async def one(i: int) -> None:
        ch = channels[i % len(channels)]
        call = ch.unary_unary("/splitserve.v1.Worker/Health", lambda b: b, lambda b: b)
        async with gate:
            try:
                await call(junk, timeout=120)
                name = "OK"
            except grpc.aio.AioRpcError as e:
                name = e.code().name
        codes[name] = codes.get(name, 0) + 1

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        for ch in channels:
            await ch.close()
    return f"{n} unauthenticated {mb} MB gRPC calls: {codes}"


def run_attack(args: argparse.Namespace) -> int:
    if args.attack == "big-prompt":
        out = asyncio.run(attack_big_prompt(args.base, args.big_mb))
    elif args.attack == "surrogates":
        out = asyncio.run(attack_surrogates(args.base))
    else:
        out = asyncio.run(attack_grpc(args.workers.split(",")))
    print(out, flush=True)
    return 0


# ---- the normal clients ----


@dataclass
class Stream:
    """One normal client: the gaps between its tokens, request by request."""

    gaps: list[float] = field(default_factory=list)
    requests: int = 0
    failures: list[str] = field(default_factory=list)

    def excess_gap(self) -> float:
        """Its largest gap less its own decode time (its median gap)."""
        if len(self.gaps) < 2:
            return 0.0
        return max(self.gaps) - statistics.median(self.gaps)


async def normal_client(c: httpx.AsyncClient, url: str, i: int, s: Stream,
                        stop: asyncio.Event) -> None:  # fmt: skip
    n = 0
    while not stop.is_set():
        prompt = [1] + [3 + (i * 37 + j * 11 + n) % 250 for j in range(40)]
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}  # fmt: skip
        n += 1
        last: float | None = None
        try:
            async with c.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    s.failures.append(f"http {r.status_code}")
                    await r.aread()
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        s.failures.append(str(chunk["error"].get("code")))
                        break
                    if any(ch.get("token_ids") for ch in chunk.get("choices", [])):
                        now = time.monotonic()
                        if last is not None:
                            s.gaps.append(now - last)
                        last = now
            s.requests += 1
        except httpx.HTTPError as e:
            s.failures.append(type(e).__name__)


# ---- the stack ----


def start_router(model: str, spec: str, token_file: Path, cfg: Path, port: int,
                 log: list[str]) -> subprocess.Popen[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "splitserve.cli", "router", "--model", model,
           "--workers", spec, "--token-file", str(token_file), "--config", str(cfg),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=env)  # fmt: skip

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line.rstrip())

    threading.Thread(target=read, daemon=True).start()
    return proc


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak(pid: int) -> None:
    """Start ``pid``'s peak resident memory from now (where the kernel allows it)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


async def held_blocks(addresses: list[str], token: str, timeout: float = 30) -> int:
    """KV blocks (and leases) still held on the workers once they are idle, or at
    ``timeout``."""
    from splitserve_worker.client import WorkerClient

    deadline = time.monotonic() + timeout
    while True:
        held = 0
        for a in addresses:
            async with WorkerClient(a, token, timeout=10) as w:
                h = await w.health()
                held += (h.total_blocks - h.free_blocks) + h.leases
        if held == 0 or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.2)


async def slowest_health(addresses: list[str], token: str, done: asyncio.Event) -> float:
    from splitserve_worker.client import WorkerClient

    slowest = 0.0
    clients = [WorkerClient(a, token, timeout=30) for a in addresses]
    try:
        while not done.is_set():
            for c in clients:
                t = time.monotonic()
                await c.health()
                slowest = max(slowest, time.monotonic() - t)
            await asyncio.sleep(0.1)
    finally:
        for c in clients:
            await c.close()
    return slowest


@dataclass
class Outcome:
    name: str
    worst_gap_s: float
    marked_down: int
    leaked: int
    detail: str


async def scenario(
    name: str,
    args: argparse.Namespace,
    base: str,
    workers: list[str],
    token: str,
    router: subprocess.Popen[str],
    log: list[str],
) -> Outcome:
    streams = [Stream() for _ in range(args.streams)]
    stop = asyncio.Event()
    log_at = len(log)
    reset_peak(router.pid)
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=limits) as c:
        clients = [asyncio.create_task(normal_client(c, f"{base}/v1/completions", i, s, stop))
                   for i, s in enumerate(streams)]  # fmt: skip
        while sum(len(s.gaps) for s in streams) < 10 * args.streams:  # all under way
            await asyncio.sleep(0.1)
        flood_done = asyncio.Event()
        probe = None
        if name == "grpc-flood":
            probe = asyncio.create_task(slowest_health(workers, token, flood_done))
        detail = "no attack"
        t0 = time.monotonic()
        if name == "quiet":
            await asyncio.sleep(args.quiet_s)
        else:
            cmd = [sys.executable, __file__, "--attack", name, "--base", base,
                   "--workers", ",".join(workers), "--big-mb", str(args.big_mb)]  # fmt: skip
            attacker = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
            out, _ = await attacker.communicate()
            detail = out.decode().strip() or f"the attacker exited with {attacker.returncode}"
        attack_s = time.monotonic() - t0
        flood_done.set()
        if probe is not None:
            detail += f"; slowest authenticated Health meanwhile {await probe:.3f} s"
        await asyncio.sleep(1.0)  # the streams go on a moment after the attack
        stop.set()
        await asyncio.gather(*clients)
    leaked = await held_blocks(workers, token)
    down = sum(1 for line in log[log_at:] if any(w in line for w in DOWN_WORDS))
    worst = max(s.excess_gap() for s in streams)
    failures = [f for s in streams for f in s.failures]
    median = statistics.median(g for s in streams for g in s.gaps)
    print(f"[{name}] attack {attack_s:.1f} s: {detail}", flush=True)
    print(f"[{name}] normal streams: {sum(s.requests for s in streams)} requests, median gap "
          f"{median * 1000:.1f} ms, worst gap less own decode time {worst:.3f} s, "
          f"failures {failures or 'none'}; workers marked down {down}; leaked blocks "
          f"{leaked}; router peak RSS {peak_rss_mb(router.pid):.0f} MB", flush=True)  # fmt: skip
    return Outcome(name, worst, down, leaked, detail)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the tiny model)")
    p.add_argument("--decode", type=int, default=1, choices=(1, 2), help="decode workers")
    p.add_argument("--streams", type=int, default=20, help="normal streaming clients")
    p.add_argument("--big-mb", type=int, default=60, help="size of the big prompt, MB")
    p.add_argument("--quiet-s", type=float, default=5.0, help="length of the quiet scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--attack", choices=SCENARIOS[1:], help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--workers", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.attack:
        return run_attack(args)
    tmp = tempfile.TemporaryDirectory(prefix="splitserve-abuse-")
    model = args.model
    if model is None:
        from support_path import use_test_support

        use_test_support()
        from tiny_models import save_tiny_llama

        model = str(save_tiny_llama(Path(tmp.name) / "tiny"))
    roles = [Role.PREFILL] + [Role.DECODE] * args.decode
    token = os.urandom(16).hex()
    log: list[str] = []
    outcomes: list[Outcome] = []
    with WorkerProcs(model, roles, token, threads=1, extra_args=["--num-blocks", "2048"],
                     echo=False) as procs:  # fmt: skip
        endpoints = procs.start(timeout_s=300)
        spec = ",".join(f"{ep.role.value}={ep.address}" for ep in endpoints)
        cfg = Path(tmp.name) / "router.json"
        cfg.write_text(json.dumps({"disaggregation": "always"}))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        router = start_router(model, spec, procs.token_file, cfg, port, log)
        base = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(wait_healthy(base))
            workers = [ep.address for ep in endpoints]
            for name in args.scenarios.split(","):
                outcomes.append(asyncio.run(scenario(name, args, base, workers, token,
                                                     router, log)))  # fmt: skip
        finally:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
    attacks = [o for o in outcomes if o.name != "quiet"] or outcomes
    print(f"RESULT worst_gap_s={max(o.worst_gap_s for o in attacks):.3f} "
          f"workers_marked_down={sum(o.marked_down for o in attacks)} "
          f"leaked_blocks={sum(o.leaked for o in attacks)}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
