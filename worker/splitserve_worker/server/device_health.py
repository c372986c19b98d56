"""Whether this worker's device can serve: CUDA there when it was asked for, and no
sticky device error since.

- At start, :func:`cuda_missing` says why a worker told ``--device cuda`` sees no CUDA
  device (a CPU build of torch, no NVIDIA runtime class, no driver, no
  ``NVIDIA_VISIBLE_DEVICES``): the worker exits with that one line instead of serving
  on the CPU. :class:`CudaProbe` reads what it decides from; the decision is pure.
- While serving, :func:`sticky_device_error` classifies an error from an engine step or
  call: the CUDA errors after which no later CUDA call of this process succeeds (an
  illegal address, a failed launch, a device-side assert, an uncorrectable ECC or NVLink
  error). :class:`DeviceHealth` latches the first one: every call is then answered
  UNAVAILABLE (the router's Health poll marks the worker down and routes around it) and
  the worker exits with :data:`DEVICE_FAILED_EXIT` so that Kubernetes restarts it.
  Other errors (a request's own, out of memory) leave the worker serving.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEVICE_FAILED_EXIT = 3
"""Exit status of a worker whose device failed (2 is a bad configuration)."""

GPU_POD_NEEDS = (
    "a GPU pod needs the NVIDIA runtime class (runtimeClassName, or the container toolkit "
    "as the node's default runtime), the NVIDIA driver on its node, and "
    "NVIDIA_VISIBLE_DEVICES set by the device plugin (request nvidia.com/gpu)"
)


NO_GPU_VISIBLE = ("", "void", "none")
"""``NVIDIA_VISIBLE_DEVICES`` values (lower case; unset reads as '') that give no GPU."""


class DeviceUnavailable(RuntimeError):
    """The worker was told to run on a device it cannot see; the message says what is
    missing."""


@dataclass(frozen=True)
class CudaProbe:
    """What decides whether CUDA can serve here, read once at start."""

    torch_version: str
    cuda_build: str | None
    """``torch.version.cuda``: the CUDA this torch was built for; None for a CPU build."""
    device_count: int
    """Devices torch sees (0 when ``torch.cuda.is_available()`` is False)."""
    visible_devices: str | None
    """``NVIDIA_VISIBLE_DEVICES`` as the container sees it (None: unset)."""
    device_nodes: int
    """``/dev/nvidia<N>`` device files in the container."""
    driver: bool
    """Whether the NVIDIA kernel driver answers (``/proc/driver/nvidia/version``)."""

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> CudaProbe:
        import torch

        env = os.environ if env is None else env
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(
            torch_version=str(torch.__version__),
            cuda_build=torch.version.cuda,
            device_count=count,
            visible_devices=env.get("NVIDIA_VISIBLE_DEVICES"),
            device_nodes=len(glob.glob("/dev/nvidia[0-9]*")),
            driver=os.path.exists("/proc/driver/nvidia/version"),
        )


def cuda_missing(device: str | None, probe: CudaProbe) -> str | None:
    """None when ``device`` is not CUDA or CUDA can serve it, else one line saying what
    is missing and what to do."""
    if device is None or not device.startswith("cuda"):
        return None
    _, _, number = device.partition(":")
    index = int(number) if number.isdigit() else 0
    if probe.device_count > index:
        return None
    head = f"--device {device}, but torch sees no such CUDA device"
    if probe.device_count:
        why = (
            f"it sees {probe.device_count} (cuda:0 to cuda:{probe.device_count - 1}): "
            "choose one of those, or request more GPUs"
        )
    elif probe.cuda_build is None:
        why = (
            f"this torch ({probe.torch_version}) is a CPU build: install a CUDA build "
            "of torch (the worker image has one)"
        )
    elif (probe.visible_devices or "").strip().lower() in NO_GPU_VISIBLE:
        shown = "unset" if probe.visible_devices is None else repr(probe.visible_devices)
        why = (
            f"NVIDIA_VISIBLE_DEVICES is {shown}: the pod got no GPU from the device "
            "plugin, or runs without the NVIDIA runtime class"
        )
    elif not probe.driver:
        why = (
            "the NVIDIA driver is not loaded (no /proc/driver/nvidia/version): install "
            "it on the node (or the GPU operator)"
        )
    elif not probe.device_nodes:
        why = (
            f"NVIDIA_VISIBLE_DEVICES={probe.visible_devices} but no /dev/nvidia* device "
            "is in the container: the NVIDIA runtime class is missing"
        )
    else:
        why = (
            f"driver and devices are there, but CUDA does not start: the driver may "
            f"be older than this torch's CUDA {probe.cuda_build} needs (nvidia-smi)"
        )
    return f"{head}: {why}; {GPU_POD_NEEDS}"


def require_device(device: str | None, probe: Callable[[], CudaProbe] = CudaProbe.read) -> None:
    """Raise :class:`DeviceUnavailable` when ``device`` is CUDA and CUDA cannot serve it."""
    if device is None or not device.startswith("cuda"):
        return
    missing = cuda_missing(device, probe())
    if missing is not None:
        raise DeviceUnavailable(missing)


STICKY_CUDA_ERRORS: dict[str, tuple[str, ...]] = {
    "cudaErrorIllegalAddress": ("an illegal memory access was encountered",
                                "CUDA_ERROR_ILLEGAL_ADDRESS"),
    "cudaErrorLaunchFailure": ("unspecified launch failure", "CUDA_ERROR_LAUNCH_FAILED"),
    "cudaErrorAssert": ("device-side assert triggered", "CUDA_ERROR_ASSERT"),
    "cudaErrorIllegalInstruction": ("an illegal instruction was encountered",
                                    "CUDA_ERROR_ILLEGAL_INSTRUCTION"),
    "cudaErrorMisalignedAddress": ("misaligned address", "CUDA_ERROR_MISALIGNED_ADDRESS"),
    "cudaErrorInvalidAddressSpace": ("operation not supported on global/shared address space",
                                     "CUDA_ERROR_INVALID_ADDRESS_SPACE"),
    "cudaErrorInvalidPc": ("invalid program counter", "CUDA_ERROR_INVALID_PC"),
    "cudaErrorHardwareStackError": ("hardware stack error", "CUDA_ERROR_HARDWARE_STACK_ERROR"),
    "cudaErrorLaunchTimeout": ("the launch timed out and was terminated",
                               "CUDA_ERROR_LAUNCH_TIMEOUT"),
    "cudaErrorECCUncorrectable": ("uncorrectable ECC error encountered",
                                  "CUDA_ERROR_ECC_UNCORRECTABLE"),
    "cudaErrorNvlinkUncorrectable": ("uncorrectable NVLink error",
                                     "CUDA_ERROR_NVLINK_UNCORRECTABLE"),
}  # fmt: skip
"""The CUDA errors that leave the device unusable to the process ("the process must be
terminated and relaunched"), by name: the runtime's message for each, and the driver
API's name (Triton and other driver-API users report that)."""

_CUDA_WORDS = ("cuda", "triton error", "acceleratorerror")


def sticky_device_error(exc: BaseException) -> str | None:
    """The sticky CUDA error ``exc`` (or what caused it) reports, as ``cudaError...``
    name and message; None for anything else."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__}: {e}"
        lowered = text.lower()
        if any(w in lowered for w in _CUDA_WORDS):
            for name, signs in STICKY_CUDA_ERRORS.items():
                if name.lower() in lowered or any(s.lower() in lowered for s in signs):
                    return f"{name}: {signs[0]}"
        e = e.__cause__ or e.__context__
    return None


class DeviceHealth:
    """The first sticky device error this worker met, if any (any thread may report)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._listeners: list[Callable[[str], None]] = []

    @property
    def failure(self) -> str | None:
        """What the device failed with, said for callers; None while it serves."""
        return self._failure

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(message)`` once, from the reporting thread, when it fails."""
        with self._lock:
            self._listeners.append(listener)

    def observe(self, exc: BaseException) -> None:
        """Look at an error from the engine: a sticky device error fails the worker."""
        why = sticky_device_error(exc)
        if why is None:
            return
        self.fail(
            f"the GPU failed with a sticky error ({why}); this worker cannot "
            "use it again and is restarting"
        )

    def fail(self, message: str) -> None:
        """Fail the worker for good with ``message`` (a sticky device error, a lost
        tensor-parallel rank); only the first failure counts."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = message
            listeners = list(self._listeners)
        log.error("%s", self._failure)
        for listener in listeners:
            listener(self._failure)
