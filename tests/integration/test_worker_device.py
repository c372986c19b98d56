"""A worker's device, on the CPU: ``--device cuda`` where no CUDA device is visible ends
the worker at start with one line naming what is missing; a sticky device error from an
engine step (here injected: the CUDA error an illegal address raises) makes the worker
answer every call UNAVAILABLE, so the router's health poll marks it down, and makes
``splitserve worker`` exit non-zero for a restart; any other step error leaves it
serving. A worker on CUDA registers the GPU metrics (NVML faked here) and one without
NVML says so in a line and serves on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from splitserve.metric_names import GPU_UTILIZATION
from splitserve.roles import Role
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.commands import worker as worker_cmd
from splitserve_worker.metrics import gpu as gpu_metrics
from splitserve_worker.router.discovery import WorkerEndpoint
from splitserve_worker.router.pool import WorkerPool
from splitserve_worker.router.prefix_index import PrefixIndex
from splitserve_worker.server.app import RunningWorker, start_worker
from splitserve_worker.server.config import WorkerConfig
from splitserve_worker.server.device_health import DEVICE_FAILED_EXIT

pytestmark = pytest.mark.integration

TOKEN = "device-token"
ILLEGAL_ADDRESS = (
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
    "asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)
SP = pb.SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model_path: Path) -> Any:
    from splitserve_worker.models import load_model

    return load_model(str(tiny_model_path))


def config(path: Path, **kw: Any) -> WorkerConfig:
    return WorkerConfig(role="both", model=str(path), token=TOKEN, num_blocks=64, threads=1,
                        **kw)  # fmt: skip


def fail_next_step(worker: RunningWorker, error: Exception) -> None:
    """The engine's next step with work raises ``error`` once, as a failed kernel does."""
    engine = worker.engine.engine
    real: Callable[[], Any] = engine.step

    def step() -> Any:
        engine.step = real
        raise error

    engine.step = step


async def generate(client: WorkerClient, rid: str) -> list[pb.TokenChunk]:
    return [c async for c in client.generate(rid, [5, 6, 7, 8], SP)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible here")
def test_device_cuda_without_a_visible_gpu_ends_the_worker_with_one_line(
    tiny_model_path: Path,
) -> None:
    env = {**os.environ, "SPLITSERVE_WORKER_TOKEN": "t"}
    env.pop("NVIDIA_VISIBLE_DEVICES", None)
    p = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "worker", "--role", "decode",
         "--model", str(tiny_model_path), "--device", "cuda", "--threads", "1"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "READY" not in p.stdout, p.stderr[-2000:]
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert line.startswith("error: --device cuda, but torch sees no such CUDA device")
    assert "CPU build" in line  # this machine's torch; the rest is what a GPU pod needs
    for needed in ("runtime class", "driver", "NVIDIA_VISIBLE_DEVICES"):
        assert needed in line, line


def test_a_sticky_device_error_makes_the_worker_unhealthy_to_the_router(
    tiny_model_path: Path, loaded: Any
) -> None:
    async def scenario() -> None:
        worker = await start_worker(config(tiny_model_path), loaded=loaded)
        client = WorkerClient(worker.address, TOKEN)
        pool = WorkerPool(lambda ep: WorkerClient(ep.address, TOKEN), PrefixIndex(),
                          health_interval_s=0.05)  # fmt: skip
        try:
            pool.set_endpoints([WorkerEndpoint("w", Role.BOTH, worker.address)])
            await until_health(pool, healthy=True)
            compat = (await client.health()).compat
            assert len(await generate(client, "before")) >= 1
            compat = (await client.health()).compat
            fail_next_step(worker, torch.AcceleratorError(ILLEGAL_ADDRESS))
            chunks = await generate(client, "hit")
            assert chunks[-1].finish_reason == "error"
            assert "illegal memory access" in chunks[-1].error
            await asyncio.wait_for(worker.device_failed.wait(), 10)
            assert "cudaErrorIllegalAddress" in (worker.device.failure or "")
            for call in (client.health(), client.reserve("next", 4, compat)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "sticky error (cudaErrorIllegalAddress" in (err.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(client, "after")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await until_health(pool, healthy=False)  # the router routes around it now
        finally:
            await pool.close()
            await client.close()
            await worker.stop(0)

    asyncio.run(scenario())


async def until_health(pool: WorkerPool, healthy: bool) -> None:
    async with asyncio.timeout(10):
        while not any(v.healthy == healthy for v in pool.snapshot()):
            await pool.wait_change(1.0)


def test_another_step_error_fails_the_batch_and_the_worker_serves_on(
    tiny_model_path: Path, loaded: Any
) -> None:
    async def scenario() -> None:
        worker = await start_worker(config(tiny_model_path), loaded=loaded)
        client = WorkerClient(worker.address, TOKEN)
        try:
            oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            fail_next_step(worker, oom)
            chunks = await generate(client, "oom")
            assert chunks[-1].finish_reason == "error" and "out of memory" in chunks[-1].error
            assert worker.device.failure is None and not worker.device_failed.is_set()
            assert (await client.health()).total_blocks == 64
            tokens = [t for c in await generate(client, "next") for t in c.token_ids]
            assert len(tokens) == SP.max_tokens
        finally:
            await client.close()
            await worker.stop(0)

    asyncio.run(scenario())


def test_serve_exits_with_the_device_failed_status_and_one_error_line(
    tiny_model_path: Path,
    loaded: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started: asyncio.Queue[RunningWorker] = asyncio.Queue()

    async def start(cfg: WorkerConfig) -> RunningWorker:
        w = await start_worker(cfg, loaded=loaded)
        started.put_nowait(w)
        return w

    # serve() imports start_worker when it runs: it starts this one, on the loaded model
    monkeypatch.setattr("splitserve_worker.server.app.start_worker", start)

    async def scenario() -> int:
        serving = asyncio.ensure_future(worker_cmd.serve(config(tiny_model_path)))
        worker = await asyncio.wait_for(started.get(), 60)
        fail_next_step(worker, RuntimeError(ILLEGAL_ADDRESS))
        async with WorkerClient(worker.address, TOKEN) as client:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await generate(client, "hit")
        return await asyncio.wait_for(serving, 60)

    assert asyncio.run(scenario()) == DEVICE_FAILED_EXIT
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert errors == [
        "error: the GPU failed with a sticky error (cudaErrorIllegalAddress: an illegal "
        "memory access was encountered); this worker cannot use it again and is restarting"
    ]


class FakeNvml:
    """The slice of pynvml the GPU collector reads: one GPU, 25 % busy."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return type("Rates", (), {"gpu": 25, "memory": 0})()

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return type("Memory", (), {"used": 1 << 30, "total": 80 << 30, "free": 79 << 30})()


@pytest.mark.parametrize("nvml", ["present", "absent"])
def test_a_cuda_worker_registers_the_gpu_metrics_at_start(
    tiny_model_path: Path,
    loaded: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    nvml: str,
) -> None:
    """The worker asks for the GPU series with its engine's device; the engine runs on
    the CPU here, so the call is answered as for CUDA (with NVML faked or absent)."""
    asked: list[str] = []
    real = gpu_metrics.register_device_metrics

    def as_on_cuda(registry: Any, device_type: str, nvml_module: Any = None) -> Any:
        asked.append(device_type)
        return real(registry, "cuda", FakeNvml() if nvml == "present" else None)

    monkeypatch.setattr(gpu_metrics, "register_device_metrics", as_on_cuda)
    if nvml == "absent":
        monkeypatch.setitem(sys.modules, "pynvml", None)

    async def scenario() -> str:
        w = await start_worker(config(tiny_model_path, metrics_port=0), loaded=loaded)
        try:
            async with httpx.AsyncClient() as http:
                r = await http.get(f"http://127.0.0.1:{w.metrics_port}/metrics")
            async with WorkerClient(w.address, TOKEN) as client:
                assert (await client.health()).total_blocks == 64  # it serves on
            return r.text
        finally:
            await w.stop(0)

    with caplog.at_level(logging.WARNING, logger=gpu_metrics.__name__):
        text = asyncio.run(scenario())
    assert asked == ["cpu"]
    if nvml == "present":
        assert f'{GPU_UTILIZATION.name}{{gpu="0"}} 0.25' in text
    else:
        assert GPU_UTILIZATION.name not in text
        (record,) = [r for r in caplog.records if r.name == gpu_metrics.__name__]
        assert record.getMessage().startswith("GPU metrics off: pynvml is not installed")


def test_without_cuda_no_gpu_series_are_registered() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    assert gpu_metrics.register_device_metrics(registry, "cpu", FakeNvml()) is None
    assert list(registry.collect()) == []
