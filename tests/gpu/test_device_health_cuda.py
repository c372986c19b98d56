"""A worker's device on a real GPU: a real illegal memory access (a Triton kernel that
writes far outside its tensor, in a process of its own, since the error leaves that
process's GPU unusable) is recognised as a sticky device error, and a worker on CUDA
serves the GPU series on ``/metrics``.

Skipped where CUDA is absent. On a GPU host: ``tests/gpu/README.md``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from splitserve.metric_names import GPU_MEMORY_TOTAL, GPU_UTILIZATION
from splitserve_worker.metrics.gpu import GpuCollector
from splitserve_worker.server.app import start_worker
from splitserve_worker.server.config import WorkerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ILLEGAL_ADDRESS = """
import torch, triton, triton.language as tl
from splitserve_worker.server.device_health import sticky_device_error

@triton.jit
def poke(ptr):
    tl.store(ptr + (1 << 40), 1.0)  # a terabyte past the tensor

x = torch.zeros(16, device="cuda")
try:
    poke[(1,)](x)
    torch.cuda.synchronize()
except Exception as e:
    first = e
else:
    raise SystemExit("no error from an illegal address")
try:
    torch.zeros(1, device="cuda").sum().item()  # sticky: every later call fails too
    later = "later calls worked"
except Exception as e:
    later = repr(e)[:200]
print("CLASS", type(first).__name__)
print("STICKY", sticky_device_error(first))
print("LATER", later)
"""


def test_a_real_illegal_address_is_a_sticky_device_error() -> None:
    p = subprocess.run([sys.executable, "-c", ILLEGAL_ADDRESS], capture_output=True,
                       text=True, timeout=180)  # fmt: skip
    out = dict(ln.split(" ", 1) for ln in p.stdout.splitlines() if " " in ln)
    assert "STICKY" in out, p.stdout + p.stderr[-3000:]
    print(p.stdout)
    assert out["STICKY"].startswith("cudaErrorIllegalAddress"), p.stdout
    assert out["LATER"] != "later calls worked", "the error was not sticky after all"


@pytest.mark.skipif(not GpuCollector().available, reason="NVML sees no GPU here")
def test_a_cuda_worker_serves_the_gpu_series(tiny_model_path: Path) -> None:
    config = WorkerConfig(role="both", model=str(tiny_model_path), token="t", device="cuda",
                          num_blocks=64, metrics_port=0)  # fmt: skip

    async def scenario() -> str:
        w: Any = await start_worker(config)
        try:
            assert w.engine.engine.device.type == "cuda"
            async with httpx.AsyncClient() as http:
                return (await http.get(f"http://127.0.0.1:{w.metrics_port}/metrics")).text
        finally:
            await w.stop(0)

    text = asyncio.run(scenario())
    assert f'{GPU_UTILIZATION.name}{{gpu="0"}}' in text
    assert f'{GPU_MEMORY_TOTAL.name}{{gpu="0"}}' in text
