"""A layer's K/V made readable for a transport without the engine thread waiting on the
device.

The engine hands a transport each layer's fresh K and V on its own thread, right after
queuing the kernels that compute them. On CUDA those tensors hold their values only
once the GPU gets there, which may be several layers later, and whatever reads them
outside CUDA's stream order (a socket's ``sendmsg``, UCX's network or copy engine) must
first wait for the copy it reads. So each copy a transport makes comes with a
:class:`Ready`, recorded after it, that the reading thread waits on:

- ``tcp`` and ``grpc`` (:class:`HostStaging`): a device layer is copied into pinned host
  memory on a side stream that first waits for the engine's stream, and the stream
  thread waits on the copy's event before ``sendmsg``; the engine thread never copies
  or waits. Host tensors (the CPU engine) are taken as they are, already done.
- ``nixl`` copies a device layer into its registered ring on the engine's stream and
  records :func:`record_current` after it; a lane posts the WRITE once it is done.

NIXL's UCX transports use the calling thread's CUDA context, so the threads that post
writes or load a remote agent first :func:`bind_device`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from splitserve_worker.kv.layout import owned


class Ready(Protocol):
    """When the copies recorded before it have finished."""

    def done(self) -> bool:
        """True once they have (never blocks)."""
        ...

    def wait(self) -> None:
        """Block until they have."""
        ...


class _Done:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE: Ready = _Done()
"""Nothing to wait for: host memory, written when the call that made it returned."""


class CudaEvent:
    """A :class:`Ready` over a ``torch.cuda.Event`` recorded on ``stream`` now."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._device = stream.device
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        with torch.cuda.device(self._device):
            self._event.synchronize()


def record_current(device: torch.device) -> Ready:
    """An event after everything queued so far on ``device``'s current stream."""
    return CudaEvent(torch.cuda.current_stream(device))


def bind_device(device: torch.device | None) -> None:
    """Make ``device``'s CUDA context current in the calling thread (UCX's CUDA transports
    work in the caller's context); nothing for host memory."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


class Stager(Protocol):
    """Takes a layer's K and V off the device for a transport that sends host bytes."""

    def to_host(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Ready]:
        """K and V in host memory (tensors the transport may keep), and when they hold
        their values. Called on the engine thread: it queues copies, it never waits."""
        ...


class HostStaging:
    """The :class:`Stager` of ``tcp`` and ``grpc``: host tensors as they are (views
    copied), CUDA tensors copied into pinned host memory on a side stream per device.

    Pinned memory comes from torch's caching host allocator: a block freed after its
    spans went out is reused by a later layer, and never while a copy into it runs (the
    allocator records the copy's stream). The sources are marked as used by the side
    stream, so the engine may drop them at once."""

    def __init__(self) -> None:
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def to_host(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Ready]:
        if k.device.type == "cpu":
            return owned(k), owned(v), DONE
        if k.device.type != "cuda":  # another accelerator: a plain, waiting copy
            return k.detach().cpu(), v.detach().cpu(), DONE
        device = k.device
        # contiguous sources first, on the engine's stream: the side stream waits for them
        srcs = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in (k, v)]
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        hosts = []
        with torch.cuda.stream(side):
            for src in srcs:
                host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                host.copy_(src, non_blocking=True)
                src.record_stream(side)
                hosts.append(host)
        return hosts[0], hosts[1], CudaEvent(side)
