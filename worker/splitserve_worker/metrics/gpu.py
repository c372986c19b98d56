"""GPU utilisation and memory through NVML (``nvidia-ml-py``, module ``pynvml``).

Where there is no GPU, no driver or no ``pynvml``, the collector exports
nothing and never raises: a CPU-only worker serves the same ``/metrics``
without the GPU series. NVML is asked at scrape time, so the numbers are as
fresh as the scrape. A worker on CUDA registers it at start
(:func:`register_device_metrics`), and says in one log line when NVML is not there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from splitserve.metric_names import GPU_MEMORY_TOTAL, GPU_MEMORY_USED, GPU_UTILIZATION

log = logging.getLogger(__name__)

PERCENT = 100.0
"""NVML reports utilisation in percent; the metric is a 0..1 ratio."""


def _load_nvml() -> tuple[ModuleType | None, str]:
    """pynvml, initialised, or None and why not."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # no driver, no device: a normal CPU host
        log.debug("NVML unavailable, GPU metrics off: %s", exc)
        return None, f"NVML did not start ({exc})"
    return pynvml, ""


class GpuCollector(Collector):
    """A Prometheus collector reading every visible GPU through NVML.

    ``nvml`` can be passed in (tests give a fake that mirrors pynvml's API);
    by default pynvml is loaded and initialised on first use, once.
    """

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml
        self._loaded = nvml is not None
        self._lock = threading.Lock()
        self.unavailable = ""
        """Why NVML gives nothing here ('' while it answers)."""

    def _get_nvml(self) -> Any | None:
        with self._lock:
            if not self._loaded:
                self._nvml, self.unavailable = _load_nvml()
                self._loaded = True
            return self._nvml

    @property
    def available(self) -> bool:
        """True when NVML answered and at least one GPU is visible."""
        nvml = self._get_nvml()
        if nvml is None:
            return False
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self.unavailable = f"NVML cannot count the GPUs ({exc})"
            return False
        if count == 0:
            self.unavailable = "NVML sees no GPU"
        return count > 0

    def describe(self) -> list[GaugeMetricFamily]:
        # Registration must not touch NVML (and must not call collect()).
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        nvml = self._get_nvml()
        if nvml is None:
            return
        util = GaugeMetricFamily(GPU_UTILIZATION.name, GPU_UTILIZATION.help, labels=["gpu"])
        used = GaugeMetricFamily(GPU_MEMORY_USED.name, GPU_MEMORY_USED.help, labels=["gpu"])
        total = GaugeMetricFamily(GPU_MEMORY_TOTAL.name, GPU_MEMORY_TOTAL.help, labels=["gpu"])
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            log.warning("NVML device count failed, no GPU metrics this scrape: %s", exc)
            return
        for index in range(count):
            gpu = str(index)
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError as exc:
                log.warning("NVML read of GPU %s failed, skipped this scrape: %s", gpu, exc)
                continue
            util.add_metric([gpu], float(rates.gpu) / PERCENT)
            used.add_metric([gpu], float(memory.used))
            total.add_metric([gpu], float(memory.total))
        yield util
        yield used
        yield total


def register_gpu_collector(registry: CollectorRegistry, nvml: Any | None = None) -> GpuCollector:
    """Adds a :class:`GpuCollector` to ``registry`` and returns it (harmless without a GPU)."""
    collector = GpuCollector(nvml)
    registry.register(collector)
    return collector


def register_device_metrics(
    registry: CollectorRegistry, device_type: str, nvml: Any | None = None
) -> GpuCollector | None:
    """The GPU series for a worker on a ``device_type`` device (``cuda``, ``cpu``): a
    :class:`GpuCollector` in ``registry`` when the device is CUDA and NVML sees a GPU.
    On CUDA without NVML, one warning says why the dashboard's GPU panel stays empty
    and the worker goes on."""
    if device_type != "cuda":
        return None
    collector = GpuCollector(nvml)
    if not collector.available:
        log.warning(
            "GPU metrics off: %s; the GPU panel stays empty (the worker image has "
            "nvidia-ml-py; the container needs NVIDIA_DRIVER_CAPABILITIES=compute,utility)",
            collector.unavailable,
        )
        return None
    registry.register(collector)
    return collector
