"""Load: N concurrent streaming clients for D seconds against a local stack.

The stack is what ``splitserve up`` starts (its own worker helper), on the tiny test
model by default: one prefill and one decode worker (``--colocated``: one ``both``
worker), and ``splitserve router`` in its own process, all on 127.0.0.1. Each client
streams completions back to back until the time is up; requests still running then
are read to their end.

How each request is counted:

- ``completed``: the stream ended with a finish reason and ``[DONE]``.
- ``throttled``: 429 answers (queue full). The client waits ``Retry-After`` seconds
  and sends the same request again; a throttled request that then completes counts as
  completed (and in ``retried_ok``), not as dropped and not as an error.
- ``errors``: any other non-200 answer, an error event inside a stream, or a request
  still throttled after ``--max-retry-s`` of retrying.
- ``dropped``: an answer that started (200) but stopped before its finish reason or
  ``[DONE]`` (connection cut, protocol error), or a request with no answer within
  ``--request-timeout-s``.

``rss_growth_mb``: resident memory of the router and workers summed, at the end minus
right after the warm-up. The warm-up lasts at least ``--warmup-s`` and until as many
requests completed as there are clients (at most ``--warmup-max-s``), so the figure is
growth under steady load, not the ramp to it.

    .venv/bin/python bench/load.py                       # 500 clients, 60 s
    .venv/bin/python bench/load.py --clients 50 --seconds 10

Ends with ``RESULT dropped=<n> errors=<n> rss_growth_mb=<x>`` (targets 0, 0, bounded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from router_ready import wait_healthy
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs


@dataclass
class Tally:
    completed: int = 0
    retried_ok: int = 0
    throttled: int = 0
    errors: int = 0
    dropped: int = 0
    tokens: int = 0
    why: Counter[str] = field(default_factory=Counter)


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, object], args: argparse.Namespace,
    tally: Tally,
) -> None:  # fmt: skip
    first_try = time.monotonic()
    throttled = False
    stage = "before the response"
    while True:
        try:
            async with asyncio.timeout(args.request_timeout_s):
                async with client.stream("POST", url, json=body) as r:
                    if r.status_code == 429:
                        tally.throttled += 1
                        throttled = True
                        wait = float(r.headers.get("retry-after", "1"))
                        if time.monotonic() - first_try + wait > args.max_retry_s:
                            tally.errors += 1
                            tally.why["throttled past --max-retry-s"] += 1
                            return
                        await r.aread()
                        await asyncio.sleep(wait * (1 + random.random() * 0.5))
                        continue
                    if r.status_code != 200:
                        tally.errors += 1
                        tally.why[f"http {r.status_code}"] += 1
                        await r.aread()
                        return
                    finished = done = False
                    stage = "mid-stream"
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            tally.errors += 1
                            tally.why[f"stream error: {chunk['error'].get('code')}"] += 1
                            return
                        for c in chunk.get("choices", []):
                            tally.tokens += len(c.get("token_ids") or [])
                            finished = finished or bool(c.get("finish_reason"))
                    if finished and done:
                        tally.completed += 1
                        tally.retried_ok += throttled
                    else:
                        tally.dropped += 1
                        tally.why["stream ended early"] += 1
                    return
        except TimeoutError:
            tally.dropped += 1
            tally.why["no answer in time"] += 1
            return
        except httpx.HTTPError as e:
            tally.dropped += 1
            cause = e.__cause__ or e.__context__
            after = time.monotonic() - first_try
            tally.why[f"{type(e).__name__} {stage} ({cause!r}, {after:.1f} s in)"] += 1
            return


async def client_loop(
    i: int, client: httpx.AsyncClient, url: str, args: argparse.Namespace, window: Window,
    tally: Tally,
) -> None:  # fmt: skip
    rng = random.Random(i)
    while time.monotonic() < window.stop_at:
        # a few shared "system prompts" so the prefix cache sees reuse, then a unique tail
        head = [1] + [3 + (rng.randrange(4) * 31 + j) % 250 for j in range(31)]
        tail = [3 + rng.randrange(250) for _ in range(rng.randrange(16, 96))]
        body = {"prompt": head + tail, "max_tokens": rng.randrange(8, args.max_tokens + 1),
                "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}  # fmt: skip
        await one_request(client, url, body, args, tally)


def start_router(
    model: str, spec: str, token_file: Path, cfg: Path, port: int
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "splitserve.cli", "router", "--model", model,
           "--workers", spec, "--token-file", str(token_file), "--config", str(cfg),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=env)  # fmt: skip

    def echo() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"[router] {line.rstrip()}", file=sys.stderr, flush=True)

    threading.Thread(target=echo, daemon=True).start()
    return proc


@dataclass
class Window:
    """When the clients stop sending (moved once the warm-up ends)."""

    stop_at: float = float("inf")


async def drive(args: argparse.Namespace, base: str, procs: dict[str, int]) -> tuple[Tally, float]:
    await wait_healthy(base, 120)
    url = f"{base}/v1/completions"
    # idle connections expire on the client before the server's 5 s keep-alive closes them,
    # so no request is sent down a connection the server is closing at that moment
    limits = httpx.Limits(max_connections=args.clients + 8,
                          max_keepalive_connections=args.clients, keepalive_expiry=2.0)  # fmt: skip
    tally = Tally()
    window = Window()
    pids = list(procs.values())

    def each() -> str:
        return " ".join(f"{name}={rss_mb([pid]):.0f}MB" for name, pid in procs.items())

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s), limits=limits) as c:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(client_loop(i, c, url, args, window, tally))
                 for i in range(args.clients)]  # fmt: skip
        # warm-up: at least --warmup-s, and until as many requests completed as there are
        # clients (every code path, buffer and connection has been used at full load)
        while time.monotonic() - t0 < args.warmup_s or (
            tally.completed < args.clients and time.monotonic() - t0 < args.warmup_max_s
        ):
            await asyncio.sleep(0.5)
        rss0 = rss_mb(pids)
        done0, t_measure = tally.completed, time.monotonic()
        window.stop_at = t_measure + args.seconds
        print(f"warm-up done after {t_measure - t0:.1f} s: {done0} completed, "
              f"rss {rss0:.1f} MB ({each()})", flush=True)  # fmt: skip
        next_report = time.monotonic() + 10
        while time.monotonic() < window.stop_at:
            await asyncio.sleep(min(1.0, max(0.0, window.stop_at - time.monotonic())))
            if time.monotonic() >= next_report:
                next_report += 10
                print(f"t={time.monotonic() - t_measure:5.1f}s completed={tally.completed} "
                      f"throttled={tally.throttled} errors={tally.errors} "
                      f"dropped={tally.dropped} rss={rss_mb(pids):.1f}MB ({each()})",
                      flush=True)  # fmt: skip
        measured_s = time.monotonic() - t_measure
        _, pending = await asyncio.wait(tasks, timeout=args.request_timeout_s + 30)
        for t in pending:
            t.cancel()
            tally.dropped += 1
            tally.why["client still running at the end"] += 1
        rss1 = rss_mb(pids)
    rate = (tally.completed - done0) / measured_s if measured_s > 0 else 0.0
    print(f"clients={args.clients} seconds={args.seconds:g} completed={tally.completed} "
          f"retried_ok={tally.retried_ok} throttled_answers={tally.throttled} "
          f"tokens={tally.tokens} completed_per_s={rate:.1f}", flush=True)  # fmt: skip
    if tally.why:
        print("failures: " + ", ".join(f"{k}: {v}" for k, v in tally.why.most_common()))
    print(f"rss after warm-up {rss0:.1f} MB, at the end {rss1:.1f} MB ({each()})", flush=True)
    return tally, rss1 - rss0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=500)
    p.add_argument("--seconds", type=float, default=60.0, help="measured time after warm-up")
    p.add_argument("--warmup-s", type=float, default=10.0, help="shortest warm-up")
    p.add_argument("--warmup-max-s", type=float, default=180.0, help="longest warm-up")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the tiny model)")
    p.add_argument("--colocated", action="store_true", help="one 'both' worker instead of 1+1")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--max-retry-s", type=float, default=120.0)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory(prefix="splitserve-load-")
    model = args.model
    if model is None:
        from support_path import use_test_support

        use_test_support()
        from tiny_models import save_tiny_llama

        model = str(save_tiny_llama(Path(tmp.name) / "tiny"))
    roles = [Role.BOTH] if args.colocated else [Role.PREFILL, Role.DECODE]
    token = os.urandom(16).hex()
    with WorkerProcs(model, roles, token, threads=1, extra_args=["--num-blocks", "4096"],
                     echo=False) as procs:  # fmt: skip
        endpoints = procs.start(timeout_s=300)
        spec = ",".join(f"{ep.role.value}={ep.address}" for ep in endpoints)
        cfg = Path(tmp.name) / "router.json"
        cfg.write_text(json.dumps({"max_model_len": 512}))
        port = free_port()
        router = start_router(model, spec, procs.token_file, cfg, port)
        try:
            named = {"router": router.pid}
            named.update({f"{wp.role.value}{i}": wp.proc.pid for i, wp in enumerate(procs.procs)})
            tally, growth = asyncio.run(drive(args, f"http://127.0.0.1:{port}", named))
        finally:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
    print(f"RESULT dropped={tally.dropped} errors={tally.errors} "
          f"rss_growth_mb={growth:.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
