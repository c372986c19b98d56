"""The real local stack for ``sim_calibration.py``: start it, time streamed completions
on it, probe it, replay a workload against it, and gauge how fast the CPU is meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from splitserve_operator.sim.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
THREADS = 1
"""Torch threads per worker: what ``splitserve up`` gives each worker."""

# ---------------------------------------------------------------- CPU weather


GAUGE_CODE = """
import sys, time
import numpy as np
a = np.random.default_rng(0).standard_normal((160, 160))
interval = float(sys.argv[1])
while True:
    t0 = time.monotonic()
    x = a
    for _ in range(8):
        x = np.tanh(x @ a)
    t1 = time.monotonic()
    print(f"{t0:.4f} {t1 - t0:.6f}", flush=True)
    time.sleep(interval)
"""


class CpuGauge:
    """How fast one thread computes right now: a separate process times a fixed
    small numpy job every ``interval_s`` (a diagnostic: how much the machine's
    other load moved between timing the engine and replaying)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            t, d = line.split()
            self.samples.append((float(t), float(d)))

    def __enter__(self) -> CpuGauge:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", GAUGE_CODE, str(self.interval_s)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)

    def mean(self, since: float = 0.0, until: float = float("inf")) -> float:
        xs = [d for t, d in self.samples if since <= t <= until]
        return float(np.mean(xs)) if xs else float("nan")


# ---------------------------------------------------------------- 2. the stack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def stack(model: str, port: int, timeout_s: float = 600.0) -> Iterator[str]:
    """``splitserve up --model M --prefill 1 --decode 1 --port P`` as a subprocess."""
    cmd = [
        sys.executable, "-m", "splitserve.cli", "up", "--model", model,
        "--prefill", "1", "--decode", "1", "--port", str(port), "--threads", str(THREADS),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    ready = threading.Event()
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            del tail[:-30]
            if "router: OpenAI API on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(timeout_s) or proc.poll() is not None:
            raise RuntimeError("splitserve up did not become ready:\n" + "\n".join(tail))
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@dataclass
class Timing:
    ttft: float
    tpot: float
    tokens: int
    stamps: list[float] = field(default_factory=list)
    """When each streamed chunk with tokens arrived (``time.perf_counter``)."""


async def complete(client, base: str, prompt: list[int], max_tokens: int) -> Timing:  # type: ignore[no-untyped-def]
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    first, last, n = None, t0, 0
    stamps: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"completion failed: {chunk['error']}")
            for c in chunk.get("choices", []):
                k = len(c.get("token_ids") or [])
                if k:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += k
                    stamps.append(now)
    if first is None:
        raise RuntimeError("no tokens streamed")
    return Timing(first - t0, (last - first) / (n - 1) if n > 1 else 0.0, n, stamps)


PROBE_PROMPT, PROBE_OUTPUT = 160, 17
PROBE_BATCH, PROBE_BATCH_OUTPUT = 6, 48


async def probe(base: str, vocab: int, seed: int) -> tuple[list[Timing], list[Timing], float]:
    """Requests sent one at a time: on an idle stack (the router prefills them on
    the decode worker), and beside one long background decode (it hands them to
    the prefill worker: a local prefill would stall that sequence)."""
    import httpx

    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(PROBE_PROMPT)]

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        await complete(client, base, prompt(), 4)  # warm up both paths' connections
        idle = [await complete(client, base, prompt(), PROBE_OUTPUT) for _ in range(5)]
        remote: list[Timing] = []
        for _ in range(3):
            bg = asyncio.create_task(complete(client, base, prompt(), 200))
            await asyncio.sleep(1.0)
            remote.append(await complete(client, base, prompt(), 4))
            await bg
        batch = await asyncio.gather(
            *(complete(client, base, prompt(), PROBE_BATCH_OUTPUT) for _ in range(PROBE_BATCH))
        )
    return idle, remote, batch_tpot(list(batch))


def batch_tpot(batch: list[Timing]) -> float:
    """Median time per token once every request of the batch is decoding: the tokens
    before the batch's last first token also wait for the others' prefills."""
    start = max(t.stamps[0] for t in batch)
    per: list[float] = []
    for t in batch:
        after = [x for x in t.stamps if x >= start]
        if len(after) > 1:
            per.append((after[-1] - after[0]) / (len(after) - 1))
    return float(np.median(per)) if per else float("nan")


async def replay(base: str, w: Workload, prompts: list[list[int]]) -> list[Timing]:
    import httpx

    limits = httpx.Limits(max_connections=len(w) + 4, max_keepalive_connections=len(w) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> Timing:
            delay = float(w.arrival[i]) - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            return await complete(client, base, prompts[i], int(w.output[i]))

        return list(await asyncio.gather(*(one(i) for i in range(len(w)))))
