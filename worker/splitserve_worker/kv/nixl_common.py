"""NIXL pieces both sides share: availability, agent creation, memory kinds, notifications."""

from __future__ import annotations

from typing import Any

import torch

from splitserve_worker.kv.transport import BackendUnavailable

POLL_IDLE_S = 0.002
POLL_BUSY_S = 0.0002


def unavailable_reason() -> str | None:
    try:
        import nixl._api  # noqa: F401
    except Exception as e:  # any import failure (missing wheel, missing libs) means "absent"
        return f"NIXL is not importable here ({type(e).__name__}: {e}); pip install nixl-cu12"
    return None


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
