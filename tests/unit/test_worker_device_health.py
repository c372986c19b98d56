"""What a worker makes of its device, decided from what it read: the one line a worker
told ``--device cuda`` without a usable GPU ends with, by what is missing; and which
errors from the engine are sticky device errors (the worker must restart) and which are
not (it serves on)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from splitserve_worker.server.device_health import (
    CudaProbe,
    DeviceHealth,
    DeviceUnavailable,
    cuda_missing,
    require_device,
    sticky_device_error,
)

pytestmark = pytest.mark.unit

GPU_POD = CudaProbe(torch_version="2.13.0", cuda_build="13.0", device_count=1,
                    visible_devices="GPU-5c1e", device_nodes=1, driver=True)  # fmt: skip


def missing(**changes: object) -> str | None:
    return cuda_missing("cuda", dataclasses.replace(GPU_POD, device_count=0, **changes))  # type: ignore[arg-type]


def test_a_cpu_device_or_a_visible_gpu_needs_nothing() -> None:
    assert cuda_missing("cpu", dataclasses.replace(GPU_POD, device_count=0)) is None
    assert cuda_missing(None, dataclasses.replace(GPU_POD, device_count=0)) is None
    assert cuda_missing("cuda", GPU_POD) is None
    assert cuda_missing("cuda:0", GPU_POD) is None


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"cuda_build": None, "torch_version": "2.13.0+cpu"},
         "this torch (2.13.0+cpu) is a CPU build: install a CUDA build"),
        ({"visible_devices": None}, "NVIDIA_VISIBLE_DEVICES is unset"),
        ({"visible_devices": "void"}, "NVIDIA_VISIBLE_DEVICES is 'void'"),
        ({"driver": False}, "the NVIDIA driver is not loaded"),
        ({"device_nodes": 0}, "NVIDIA_VISIBLE_DEVICES=GPU-5c1e but no /dev/nvidia* device "
                              "is in the container: the NVIDIA runtime class is missing"),
        ({}, "driver and devices are there, but CUDA does not start: the driver may be "
             "older than this torch's CUDA 13.0 needs"),
    ],
)  # fmt: skip
def test_the_line_says_what_is_missing_first_then_what_a_gpu_pod_needs(
    changes: dict[str, object], says: str
) -> None:
    line = missing(**changes)
    assert line is not None and "\n" not in line
    assert line.startswith(f"--device cuda, but torch sees no such CUDA device: {says}")
    for needed in ("NVIDIA runtime class", "NVIDIA driver", "NVIDIA_VISIBLE_DEVICES"):
        assert needed in line


def test_a_device_index_past_the_visible_ones_names_those_there_are() -> None:
    line = cuda_missing("cuda:2", dataclasses.replace(GPU_POD, device_count=2))
    assert line is not None and "it sees 2 (cuda:0 to cuda:1)" in line


def test_require_device_reads_the_host_only_for_cuda() -> None:
    def probe() -> CudaProbe:
        raise AssertionError("a CPU worker reads nothing about CUDA")

    require_device("cpu", probe)
    require_device(None, probe)
    no_gpu = dataclasses.replace(GPU_POD, visible_devices="", device_count=0)
    with pytest.raises(DeviceUnavailable, match="NVIDIA_VISIBLE_DEVICES is ''"):
        require_device("cuda", lambda: no_gpu)


def test_the_probe_reads_this_host() -> None:
    probe = CudaProbe.read({"NVIDIA_VISIBLE_DEVICES": "all"})
    assert probe.torch_version == torch.__version__ and probe.cuda_build == torch.version.cuda
    assert probe.visible_devices == "all"
    assert probe.device_count == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


STICKY = [
    ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
     "asynchronously reported", "cudaErrorIllegalAddress"),
    ("CUDA error: unspecified launch failure", "cudaErrorLaunchFailure"),
    ("CUDA error: device-side assert triggered", "cudaErrorAssert"),
    ("CUDA error: uncorrectable ECC error encountered", "cudaErrorECCUncorrectable"),
    ("CUDA error: misaligned address", "cudaErrorMisalignedAddress"),
    ("Triton Error [CUDA]: an illegal instruction was encountered",
     "cudaErrorIllegalInstruction"),
    ("CUDA driver error: CUDA_ERROR_LAUNCH_FAILED", "cudaErrorLaunchFailure"),
]  # fmt: skip


@pytest.mark.parametrize(("message", "name"), STICKY)
def test_sticky_cuda_errors_are_recognised_by_their_message(message: str, name: str) -> None:
    for exc in (torch.AcceleratorError(message), RuntimeError(message)):
        why = sticky_device_error(exc)
        assert why is not None and why.startswith(f"{name}: "), (message, why)


def test_a_sticky_error_is_found_behind_the_error_it_caused() -> None:
    try:
        try:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("sampling failed") from inner
    except ValueError as outer:
        assert sticky_device_error(outer) == (
            "cudaErrorIllegalAddress: an illegal memory access was encountered"
        )


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: invalid argument"),
        RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasGemmEx"),
        ValueError("misaligned address in a request"),  # the words, but not from CUDA
        KeyError("r1"),
    ],
)
def test_other_errors_are_not_sticky(exc: BaseException) -> None:
    assert sticky_device_error(exc) is None


def test_device_health_latches_the_first_sticky_error_and_tells_once() -> None:
    health = DeviceHealth()
    told: list[str] = []
    health.on_failure(told.append)
    health.observe(torch.OutOfMemoryError("CUDA out of memory"))
    assert health.failure is None and told == []
    health.observe(RuntimeError("CUDA error: unspecified launch failure"))
    health.observe(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert told == [health.failure]
    assert health.failure is not None and "cudaErrorLaunchFailure" in health.failure
