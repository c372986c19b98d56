"""NIXL pieces both sides share: availability, agent creation, memory kinds, notifications.

NIXL ships one wheel per CUDA major (``nixl-cu12``, ``nixl-cu13``) and a meta package,
``nixl``, whose loader picks the one matching ``torch.version.cuda`` and refuses the
other: :func:`nixl_package` names the wheel for this torch (a CPU torch takes either;
``nixl-cu12`` is the one tried on CPU hosts); the Makefile and the worker image install
what it names.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from splitserve_worker.kv.transport import BackendUnavailable

POLL_IDLE_S = 0.002
POLL_BUSY_S = 0.0002


NIXL_VERSION = "1.5.1"
"""The NIXL release installed and tested (the meta package and the per-CUDA wheel)."""
CPU_NIXL_PACKAGE = "nixl-cu12"
"""What a CPU torch takes: NIXL's loader then uses whichever wheel is installed, and this
one imports and moves host memory without a GPU."""


def nixl_package(cuda: str | None = None) -> str:
    """The NIXL wheel for a torch built for CUDA ``cuda`` (``torch.version.cuda`` by
    default; ``None``: a CPU build)."""
    if cuda is None:
        cuda = torch.version.cuda
    if not cuda:
        return CPU_NIXL_PACKAGE
    return f"nixl-cu{cuda.split('.')[0]}"


def install_hint(cuda: str | None = None) -> str:
    """The command that installs NIXL for this torch: the meta package without its
    dependencies (it would pull both CUDA wheels, and a CUDA torch with them)."""
    pkg = nixl_package(cuda)
    return f"pip install --no-deps {pkg}=={NIXL_VERSION} nixl=={NIXL_VERSION}"


def unavailable_reason() -> str | None:
    try:
        import nixl._api  # noqa: F401
    except Exception as e:  # any import failure (missing wheel, missing libs) means "absent"
        cuda = torch.version.cuda
        built = f"built for CUDA {cuda}" if cuda else "a CPU build"
        return (
            f"NIXL is not importable here ({type(e).__name__}: {e}); this torch "
            f"({torch.__version__}) is {built}: {install_hint(cuda)}"
        )
    return None


def loopback_tls(gpus: bool | None = None) -> str:
    """UCX transports for NIXL between processes on one host: CMA and TCP; where NVIDIA
    GPUs are present NIXL refuses a list without CUDA support, so ``cuda_copy`` and
    ``cuda_ipc`` (GPU to GPU) join them."""
    gpus = torch.cuda.is_available() if gpus is None else gpus
    return "cma,tcp,cuda_copy,cuda_ipc" if gpus else "cma,tcp"


def loopback_env() -> None:
    """Set UCX's transports for NIXL on one host (tests, benches, `up`), unless already set."""
    os.environ.setdefault("UCX_TLS", loopback_tls())
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def make_agent(name: str) -> Any:
    reason = unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(reason)
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    config = nixl_agent_config(
        enable_prog_thread=False,
        backends=["UCX"],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    return nixl_agent(name, config)


def mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


def device_id(t: torch.Tensor) -> int:
    return t.get_device() if t.is_cuda else 0


def notif(request_id: str, lease_id: str, layer: int, end: int) -> bytes:
    return f"{request_id}\x00{lease_id}\x00{layer}\x00{end}".encode()


def parse_notif(msg: bytes) -> tuple[str, str, int, int]:
    """``(request_id, lease_id, layer, end_token)`` of a layer notification."""
    rid, lid, layer, end = msg.decode().split("\x00")
    return rid, lid, int(layer), int(end)


Desc = tuple[int, int, int]
"""A NIXL memory descriptor: (address, bytes, device id)."""


def coalesce(local: list[Desc], remote: list[Desc]) -> tuple[list[Desc], list[Desc]]:
    """Merge neighbouring descriptor pairs that continue each other on both sides.

    Blocks reserved together are usually adjacent in the pool, and a layer's
    fresh K/V is contiguous, so a layer's per-block spans mostly collapse into a
    few large writes: fewer descriptors, less per-descriptor overhead in UCX.
    """
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local descriptors but {len(remote)} remote ones")
    out_l: list[Desc] = []
    out_r: list[Desc] = []
    for (la, ln, ld), (ra, rn, rd) in zip(local, remote, strict=True):
        if ln != rn:
            raise ValueError(f"descriptor sizes differ: local {ln} bytes, remote {rn} bytes")
        if out_l:
            pla, pln, pld = out_l[-1]
            pra, prn, prd = out_r[-1]
            if pld == ld and prd == rd and pla + pln == la and pra + prn == ra:
                out_l[-1] = (pla, pln + ln, pld)
                out_r[-1] = (pra, prn + rn, prd)
                continue
        out_l.append((la, ln, ld))
        out_r.append((ra, rn, rd))
    return out_l, out_r
