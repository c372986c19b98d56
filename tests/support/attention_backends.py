"""The attention backends the engine can run here, as pytest parameters: identity tests
run over each of them (on the CPU: sdpa, and flex where a C++ compiler is installed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from splitserve_worker.engine.attention.registry import unavailable_reason

BACKENDS = ("sdpa", "flex", "flashinfer")


def backend_params(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[Any]:
    """``pytest.param(name, id=name)`` for every backend that runs on ``device``."""
    return [pytest.param(name, id=name) for name in available(device, dtype)]


def paged_params(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[Any]:
    """The same, for the backends with static decode plans (what CUDA graphs replay)."""
    return [p for p in backend_params(device, dtype) if p.id == "flex"]


def available(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    """The backends that run here."""
    return [n for n in BACKENDS if unavailable_reason(n, torch.device(device), dtype) is None]
