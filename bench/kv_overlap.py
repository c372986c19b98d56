"""The overlap part of ``bench/kv_transfer.py``: how much KV transfer a real prefill leaves
exposed.

Real ``splitserve worker`` processes (prefill and decode, one thread each) on the built-in
model; for a prompt of ``prompt_len`` tokens, the transfer time still exposed after prefill
compute ends, as a fraction of the whole transfer time (both from the ``PrefillResponse``
timings; the first run is a warm-up, the rest are summed).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from typing import Any

TOKEN = "bench-token"


def _spawn_worker(model: str, role: str, backend: str) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, SPLITSERVE_WORKER_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "splitserve.cli", "worker", "--role", role, "--model",
           model, "--port", "0", "--threads", "1", "--kv-backend", backend]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)  # fmt: skip
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY ") and not found:
                found.append(line.split()[1])

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 300
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not found:
        proc.kill()
        raise SystemExit(f"the {role} worker did not start")
    return proc, found[0]


def bench_exposed(model: str, backend: str, repeats: int, prompt_len: int) -> float:
    from splitserve.v1 import worker_pb2 as pb
    from splitserve_worker.client import WorkerClient

    procs = [_spawn_worker(model, role, backend) for role in ("prefill", "decode")]
    sp = pb.SamplingParams(max_tokens=2, ignore_eos=True)

    async def run() -> float:
        p, d = (WorkerClient(addr, TOKEN) for _, addr in procs)
        exposed = total = 0.0
        for i in range(repeats + 1):
            prompt = [100 + (i * 7919 + j * 31) % 40000 for j in range(prompt_len)]
            rid = f"exp-{backend}-{i}"
            compat = (await p.health()).compat
            handle = await d.reserve(
                rid, len(prompt), compat, kv_backend=backend, lease_seconds=600
            )
            gen = d.generate(rid, prompt, sp, expect_remote_kv=True)
            task = asyncio.ensure_future(_drain(gen))
            r = await p.prefill(rid, prompt, sp, handle, timeout=600)
            await task
            print(f"  {backend} run {i}: prefill {r.prefill_seconds:.2f} s, transfer "
                  f"{r.transfer_seconds:.3f} s, exposed {r.exposed_transfer_seconds * 1e3:.1f} ms, "
                  f"{r.bytes_sent / 1e6:.0f} MB", flush=True)  # fmt: skip
            if i:
                exposed += r.exposed_transfer_seconds
                total += r.transfer_seconds
        await p.close()
        await d.close()
        return exposed / total if total else 1.0

    try:
        return asyncio.run(run())
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(30)


async def _drain(gen: Any) -> None:
    async for _ in gen:
        pass
