"""The NVML collector: real values through a fake that mirrors pynvml's API, nothing
(and no error) without a GPU, and the real thing where a GPU exists."""

from __future__ import annotations

import builtins
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from splitserve.metric_names import GPU_MEMORY_TOTAL, GPU_MEMORY_USED, GPU_UTILIZATION
from splitserve_worker.metrics.gpu import GpuCollector, register_gpu_collector


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    """The slice of pynvml the collector uses."""

    NVMLError = FakeNVMLError

    def __init__(
        self, devices: list[tuple[int, int, int]], broken: frozenset[int] = frozenset()
    ) -> None:
        self.devices = devices  # (util %, used bytes, total bytes)
        self.broken = broken

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i in self.broken:
            raise FakeNVMLError("GPU is lost")
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self.devices[h][0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        _, used, total = self.devices[h]
        return SimpleNamespace(used=used, total=total, free=total - used)


def _values(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    out = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, s.labels.get("gpu", ""))] = s.value
    return out


@pytest.mark.unit
def test_values_from_nvml() -> None:
    registry = CollectorRegistry()
    register_gpu_collector(registry, FakeNvml([(50, 10, 100), (100, 80, 100)]))
    v = _values(registry)
    assert v[(GPU_UTILIZATION.name, "0")] == 0.5  # 50 % -> 0.5
    assert v[(GPU_UTILIZATION.name, "1")] == 1.0
    assert v[(GPU_MEMORY_USED.name, "1")] == 80
    assert v[(GPU_MEMORY_TOTAL.name, "0")] == 100


@pytest.mark.unit
def test_a_failing_gpu_is_skipped_not_fatal() -> None:
    registry = CollectorRegistry()
    nvml = FakeNvml([(50, 10, 100), (70, 20, 100)], broken=frozenset({0}))
    register_gpu_collector(registry, nvml)
    v = _values(registry)
    assert (GPU_UTILIZATION.name, "0") not in v
    assert v[(GPU_UTILIZATION.name, "1")] == 0.7


@pytest.mark.unit
def test_no_pynvml_exports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_pynvml(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "pynvml":
            raise ImportError("no pynvml here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    registry = CollectorRegistry()
    collector = register_gpu_collector(registry)
    assert not collector.available
    assert b"gpu" not in generate_latest(registry)


@pytest.mark.unit
def test_no_driver_exports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")

    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    collector = GpuCollector()
    assert not collector.available
    assert list(collector.collect()) == []
    assert collector.unavailable.startswith("NVML did not start")


def _has_gpu() -> bool:
    return GpuCollector().available


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="no NVIDIA GPU (NVML) on this machine")
def test_real_gpu_is_reported() -> None:
    registry = CollectorRegistry()
    register_gpu_collector(registry)
    v = _values(registry)
    assert v[(GPU_MEMORY_TOTAL.name, "0")] > 0
    assert 0.0 <= v[(GPU_UTILIZATION.name, "0")] <= 1.0
