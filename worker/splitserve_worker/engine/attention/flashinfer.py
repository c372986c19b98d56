"""FlashInfer's paged decode kernels (CUDA, half precision), for decode rows: its pages
``[num_blocks, block_size, kv_heads, head_dim]`` ("NHD") are the pool's own layout, so it
reads the blocks in place. Prefill rows go through :func:`.sdpa.prefill_attention`.

Only made when ``flashinfer`` imports (``pip install flashinfer-python``; its kernels
compile with nvcc on first use) on a CUDA device in bfloat16 or float16. Its plan is
host work per forward, so it runs eagerly (no CUDA graphs).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitserve_worker.engine.attention.base import AttentionShape, Span
from splitserve_worker.engine.attention.sdpa import Prefill, prefill_attention, prefill_plan

WORKSPACE_BYTES = 128 * 1024 * 1024
"""FlashInfer's scratch space for split-KV decode (its documented default)."""


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashInfer cannot run here, or ``None``."""
    if device.type != "cuda":
        return "flashinfer runs on CUDA only"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"flashinfer's decode kernels take bfloat16 or float16, not {dtype}: pass --dtype"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed: pip install flashinfer-python"
    return None


@dataclass
class FlashInferPlan:
    has_decode: bool
    rows: torch.Tensor | None
    prefills: list[Prefill]


class FlashInferAttention:
    name = "flashinfer"

    def __init__(self, shape: AttentionShape) -> None:
        reason = unavailable_reason(shape.device, shape.dtype)
        if reason is not None:
            raise RuntimeError(reason)
        flashinfer: Any = importlib.import_module("flashinfer")
        self.shape = shape
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=shape.device)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=shape.group >= 4
        )

    def plan(self, spans: Sequence[Span]) -> FlashInferPlan:
        shape = self.shape
        bs, device = shape.block_size, shape.device
        decode = [s for s in spans if s.is_decode]
        prefills = [prefill_plan(s, bs, device) for s in spans if not s.is_decode]
        if decode:
            indptr = [0]
            pages: list[int] = []
            last: list[int] = []
            for s in decode:
                n = (s.end + bs - 1) // bs
                pages.extend(s.block_table[:n])
                indptr.append(len(pages))
                last.append(s.end - (n - 1) * bs)

            def ints(x: list[int]) -> torch.Tensor:
                return torch.tensor(x, dtype=torch.int32, device=device)

            self._wrapper.plan(
                ints(indptr), ints(pages), ints(last), shape.num_heads, shape.num_kv_heads,
                shape.head_dim, bs, pos_encoding_mode="NONE", q_data_type=shape.dtype,
                kv_data_type=shape.dtype, sm_scale=shape.scale,
            )  # fmt: skip
        rows = None
        if decode and prefills:
            rows = torch.tensor([s.lo for s in decode], dtype=torch.long, device=device)
        return FlashInferPlan(bool(decode), rows, prefills)

    def attend(
        self, plan: FlashInferPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kb: torch.Tensor, vb: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        if plan.has_decode and not plan.prefills:
            out: torch.Tensor = self._wrapper.run(q, (kb, vb))
            return out
        out = torch.empty_like(q)
        if plan.has_decode:
            assert plan.rows is not None
            out[plan.rows] = self._wrapper.run(q[plan.rows], (kb, vb))
        for p in plan.prefills:
            out[p.lo : p.hi] = prefill_attention(p, q, k, v, kb, vb, self.shape.scale)
        return out
